"""benchmarks/profile_compare.py: grouped plans against the others, two profiles of the same cases."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
    spec = importlib.util.spec_from_file_location("profile_compare", os.path.join(ROOT, "benchmarks", "profile_compare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path, times):
    """One case per family; ``times`` {plan: ms}, plans named grouped-* in the grouped layout, *-c on
    a 64 x 64 tile, the others on 128 x 128."""
    lines = []
    for case in ("n32k:Q16K16/sliding_tile/x:bf16", "n32k:Q64K64/importance_topk/y:bf16"):
        for plan, ms in times.items():
            tile = 64 if plan.endswith("-c") else 128
            kernel = {"family": "hopper", "tile_q": tile, "tile_kv": tile, "stages": 2, "warps": tile // 16}
            spec = {"q_layout": "grouped" if plan.startswith("grouped") else "natural", "kernel": kernel}
            lines.append({"type": "plan", "case": case, "plan": plan, "spec": spec, "status": "ok", "latency_ms": ms})
        lines.append({"type": "plan", "case": case, "plan": "broken", "status": "failed"})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_the_grouped_plans_are_measured_against_the_drift_of_the_others(tmp_path):
    script = load_script()
    old = write(tmp_path / "old.jsonl", {"grouped-a": 4.0, "direct-b": 2.0, "direct-c": 8.0})
    new = write(tmp_path / "new.jsonl", {"grouped-a": 2.7, "direct-b": 1.8, "direct-c": 7.2})  # drift 0.9, grouped 0.675
    lines = script.compare(old, new)
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line for line in lines[2:]}
    assert set(rows) == {("family", "Q16K16"), ("family", "Q64K64"), ("source", "importance_topk"),
                         ("source", "sliding_tile"), ("kernel", "hopper 128x128 s2w8"), ("kernel", "hopper 64x64 s2w4")}
    cells = [cell.strip() for cell in rows["family", "Q16K16"].strip("|").split("|")]
    assert cells[2] == "0.675 (1)" and cells[3] == "0.900 (2)" and cells[4] == "0.750"
    assert cells[5] == "0.900 (1)"  # fastest plan 1.8 over 2.0
    cells = [cell.strip() for cell in rows["kernel", "hopper 128x128 s2w8"].strip("|").split("|")]
    assert cells[2] == "0.675 (2)" and cells[3] == "0.900 (2)"  # both cases, by kernel
    cells = [cell.strip() for cell in rows["kernel", "hopper 64x64 s2w4"].strip("|").split("|")]
    assert cells[2] == "nan (0)" and cells[3] == "0.900 (2)"  # direct-c alone: 7.2 / 8.0 in both cases
    assert script.main([str(old), str(new), "--md", str(tmp_path / "cmp.md")]) == 0
    assert "0.750" in (tmp_path / "cmp.md").read_text()
