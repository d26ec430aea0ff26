"""The plan-table loader on hostile input: random bytes, truncations, non-UTF-8 text, deep nesting,
out-of-range numbers, oversized files and wrong-typed fields behind a valid checksum. Every file
either loads or raises ``PlanTableError``; through ``$TESSERA_PLAN_TABLE`` a bad file is a warning
and the cost-model fallback, never an exception from an attention call."""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera_diffusers import block_sparse_attention, plan_table
from tessera_diffusers.errors import PlanTableError
from tessera_diffusers.plan_table import (
    STAT_NAMES,
    TABLE_ENV,
    PlanTable,
    body_digest,
    load_plan_table,
    load_table_file,
    load_table_version,
    plan_from_dict,
    shipped_table_path,
    tile_group,
)
from tessera_diffusers.testing import check_against_reference, random_mask, random_qkv

SHIPPED_TEXT = shipped_table_path("sm90").read_text()
SHIPPED_BYTES = SHIPPED_TEXT.encode()
DELETE = object()  # a mutation that removes the field
# Wrong-typed values put in place of every kind of field (by name).
WRONG = {"null": None, "list": [0], "object": {"x": 0}, "string": "x", "bool": True, "negative": -1,
         "huge": 10**400, "nan": math.nan, "deleted": DELETE}
# Numbers JSON may spell but a table cannot hold, by name.
OUT_OF_RANGE = {"5000-digits": "9" * 5000, "-5000-digits": "-" + "9" * 5000, "401-digits": "1" + "0" * 400,
                "1e999": "1e999", "-1e999": "-1e999", "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity"}


@pytest.fixture(autouse=True)
def fresh_table_loads():
    """Table loads are cached per (path, mtime): no outcome of one test's files leaks into another."""
    load_table_version.cache_clear()
    yield
    load_table_version.cache_clear()


def outcome_of_file(path: Path) -> PlanTable | PlanTableError:
    """What loading ``path`` gives: a table or a PlanTableError (anything else propagates)."""
    try:
        return load_plan_table(path)
    except PlanTableError as err:
        return err


def outcome_of_data(data: Any) -> PlanTable | PlanTableError:
    try:
        return PlanTable.from_dict(data, source="fuzzed table")
    except PlanTableError as err:
        return err


def check_files(tmp_path: Path, contents: list[bytes]) -> list[PlanTable | PlanTableError]:
    """Load each of ``contents`` from a file; every outcome is a table or a PlanTableError."""
    path = tmp_path / "plan_table.json"
    outcomes, escaped = [], []
    for i, raw in enumerate(contents):
        path.write_bytes(raw)
        try:
            outcomes.append(outcome_of_file(path))
        except Exception as err:  # noqa: BLE001 - what the loader let escape, reported below
            escaped.append(f"case {i} ({raw[:60]!r}...): {type(err).__name__}: {str(err)[:200]}")
    assert not escaped, "\n".join(escaped)
    return outcomes


def resign(data: dict) -> dict:
    """``data`` with the checksum of its body again, so that the schema checks must catch an edit;
    a body the checksum cannot serialize (NaN, nesting past the recursion limit) keeps a wrong one."""
    try:
        data["sha256"] = body_digest(data.get("table"))
    except (TypeError, ValueError, RecursionError):
        data["sha256"] = "0" * 64
    return data


def exercise(table: PlanTable) -> None:
    """What the selector does with a table that loaded: none of it may raise."""
    rng = random.Random(0)
    for key_table in table.keys.values():
        for bucket in key_table.buckets.values():
            table.features.buckets.label(bucket.bucket)
            for _ in range(4):
                bucket.tree.regime_of([rng.uniform(0.0, 2.0) for _ in STAT_NAMES])
    table.catalog_mismatch(())
    table.sources_mismatch("0" * 16, "1" * 16)
    assert PlanTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table


# -- the file: bytes, text, JSON -----------------------------------------------------------------

def test_the_shipped_table_loads_as_written():
    table = load_plan_table(shipped_table_path("sm90"))
    assert table.arch == "sm90" and table.keys and table.plans
    assert json.dumps(table.to_dict(), indent=1, sort_keys=True) + "\n" == SHIPPED_TEXT  # what save() wrote
    exercise(table)


def test_random_bytes_and_token_soup(tmp_path):
    rng = random.Random(7)
    tokens = ["{", "}", "[", "]", ",", ":", '"format"', '"tessera-plan-table"', '"schema_version"', "1", '"table"',
              '"sha256"', "null", "true", "-3", "1e999", '"arch"', '"keys"', '"x"', " ", "\n", "0.5"]
    contents = [rng.randbytes(rng.randint(0, 512)) for _ in range(200)]
    contents += ["".join(rng.choice(tokens) for _ in range(rng.randint(1, 80))).encode() for _ in range(200)]
    outcomes = check_files(tmp_path, contents)
    assert all(isinstance(o, PlanTableError) for o in outcomes)


def test_truncations_of_the_shipped_table(tmp_path):
    rng = random.Random(11)
    size = len(SHIPPED_BYTES)
    offsets = sorted({0, 1, 2, size // 2, size - 2, size - 1, *(rng.randrange(size) for _ in range(150))})
    outcomes = check_files(tmp_path, [SHIPPED_BYTES[:n] for n in offsets])
    for n, outcome in zip(offsets, outcomes):
        if n < size - 1:  # cut inside the JSON document (only the final newline may go)
            assert isinstance(outcome, PlanTableError), n


def test_bytes_that_are_not_utf8(tmp_path):
    rng = random.Random(13)
    bad = [b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80\x80"]
    contents = []
    for _ in range(60):
        at = rng.randrange(len(SHIPPED_BYTES))
        contents.append(SHIPPED_BYTES[:at] + rng.choice(bad) + SHIPPED_BYTES[at + 1:])
    contents += [SHIPPED_TEXT.encode("utf-16"), SHIPPED_TEXT.encode("utf-32"), b"\xef\xbb\xbf" + SHIPPED_BYTES]
    outcomes = check_files(tmp_path, contents)
    assert all(isinstance(o, PlanTableError) for o in outcomes)
    assert "not UTF-8" in str(outcomes[0])


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 100_000 + "1" + "}" * 100_000,
        '{"format": "tessera-plan-table", "schema_version": 2, "sha256": "", "table": ' + "[" * 100_000,
    ],
    ids=["open", "closed", "objects", "in-envelope"],
)
def test_deep_nesting(tmp_path, text):
    (outcome,) = check_files(tmp_path, [text.encode()])
    assert isinstance(outcome, PlanTableError) and "nested too deeply" in str(outcome)


@pytest.mark.parametrize("depth", [100, 900, 980, 3000])
def test_deep_nesting_inside_a_signed_body(tmp_path, depth):
    """Nesting near the interpreter's recursion limit, where the checksum's own serializer (or the
    test's) may give up: the outcome is a table or a PlanTableError either way."""
    data = json.loads(SHIPPED_TEXT)
    nested: Any = 0
    for _ in range(depth):
        nested = [nested]
    data["table"]["provenance"]["records"] = nested
    resign(data)
    try:
        text = json.dumps(data)
    except RecursionError:
        text = json.dumps(resign(json.loads(SHIPPED_TEXT)))[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    (outcome,) = check_files(tmp_path, [text.encode()])
    if isinstance(outcome, PlanTable):
        exercise(outcome)


@pytest.mark.parametrize("number", list(OUT_OF_RANGE.values()), ids=list(OUT_OF_RANGE))
def test_numbers_out_of_range(tmp_path, number):
    """As the schema version, and in place of a sample of the shipped table's numeric fields."""
    rng = random.Random(17)
    envelope = f'{{"format": "tessera-plan-table", "schema_version": {number}, "table": {{}}}}'
    fields = [m.span(2) for m in re.finditer(r'("\w+": )(-?\d[\d.eE+-]*)', SHIPPED_TEXT)]
    assert len(fields) > 100
    contents = [envelope.encode()]
    for start, end in rng.sample(fields, 25):
        contents.append((SHIPPED_TEXT[:start] + number + SHIPPED_TEXT[end:]).encode())
    outcomes = check_files(tmp_path, contents)
    assert all(isinstance(o, PlanTableError) for o in outcomes)
    assert re.search("digits|float range|not a JSON number", str(outcomes[0]))


# -- the schema: wrong-typed fields behind a valid checksum --------------------------------------

def shipped_with_rules() -> dict:
    """The shipped table's JSON with a schedule rule and a plan rule added (it has neither), so that
    the walk below reaches their fields too. Valid as it stands."""
    data = json.loads(SHIPPED_TEXT)
    body = data["table"]
    plans = {name: plan_from_dict(spec) for name, spec in body["plans"].items()}
    pair = next((a, b) for a in plans for b in plans if a < b and tile_group(plans[a]) == tile_group(plans[b]))
    stat = body["features"]["stats"][0]
    regimes = [r for key in body["keys"].values() for bucket in key["buckets"].values() for r in bucket["regimes"]]
    ruled = next(r for r in regimes if r["choice"] in ("ranking", "cost_model") and len(r["ranking"]) >= 2)
    ruled["schedules"] = [{"stat": stat, "le": 0.1, "below": pair[0], "above": pair[1], "cases": [3, 4]}]
    ruled["choice"] = "plan_rule"
    ruled["plan_rule"] = {"stat": stat, "le": 0.2, "below": ruled["ranking"][0][0], "above": ruled["ranking"][1][0],
                          "cases": [5, 6]}
    resign(data)
    exercise(PlanTable.from_dict(data))
    return data


def field_paths(node: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into ``node`` (the root included), depth first."""
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from field_paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from field_paths(value, (*path, i))


def shape_of(body: dict, path: tuple) -> str:
    """The path with list indices and the names of plans, keys and buckets left out: which kind of
    field it reaches (``keys/*/buckets/*/regimes/[]/ranking/[]/[]``)."""
    parts, node = [], body
    for step in path:
        named = bool(parts) and parts[-1] in ("plans", "keys", "buckets") and parts[-2:-1] != ["features"]
        parts.append("[]" if isinstance(node, list) else "*" if named else str(step))
        node = node[step]
    return "/".join(parts)


@contextlib.contextmanager
def mutated(data: dict, path: tuple, value: Any) -> Iterator[Any]:
    """``data["table"]`` with the field at ``path`` replaced by ``value`` (or removed), restored after;
    yields the field's value before."""
    parent, key = (data, "table") if not path else (data["table"], path[0])
    for step in path[1:]:
        parent, key = parent[key], step
    old = parent[key]
    before = list(parent.items()) if isinstance(parent, dict) else None
    if value is DELETE:
        del parent[key]
    else:
        parent[key] = value
    try:
        yield old
    finally:
        if before is None:
            if value is DELETE:
                parent.insert(key, old)
            else:
                parent[key] = old
        else:
            parent.clear()
            parent.update(before)


def mutation_cases() -> list[tuple[tuple, str]]:
    """Every kind of field (``shape_of``) at a seeded place, with every wrong value; then a seeded
    sample of any field with any wrong value."""
    body = shipped_with_rules()["table"]
    rng = random.Random(23)
    by_shape: dict[str, list[tuple]] = {}
    for path in field_paths(body):
        by_shape.setdefault(shape_of(body, path), []).append(path)
    cases = [(rng.choice(paths), name) for paths in by_shape.values() for name in WRONG]
    every = [path for paths in by_shape.values() for path in paths]
    cases += [(rng.choice(every), rng.choice(list(WRONG))) for _ in range(60)]
    return cases


def test_wrong_typed_fields_behind_a_valid_checksum():
    data = shipped_with_rules()
    cases = mutation_cases()
    keys_named = {str(step) for path, _ in cases for step in path if isinstance(step, str)}
    assert {"block_q", "tile_q", "stats", "batch_heads", "ranking", "tree", "le", "schedules", "plan_rule",
            "calibration", "kernel_sources"} <= keys_named
    escaped, loaded_retyped = [], []
    for path, name in cases:
        with mutated(data, path, WRONG[name]) as old:
            resign(data)
            try:
                outcome = outcome_of_data(data)
                if isinstance(outcome, PlanTable):
                    exercise(outcome)
            except Exception as err:  # noqa: BLE001 - reported below, with the field
                escaped.append(f"{'/'.join(map(str, path))} = {name}: {type(err).__name__}: {str(err)[:200]}")
                continue
        if isinstance(outcome, PlanTableError):
            # A wrong-typed field gets a message of its own, not the parser's last-line net.
            assert "malformed table (" not in str(outcome), (path, name, str(outcome))
        elif name in ("list", "object", "string", "bool") and type(old) is not type(WRONG[name]) \
                and path[:1] != ("provenance",):  # provenance notes are free-form, its hashes are checked
            loaded_retyped.append(f"{'/'.join(map(str, path))} = {name}")
    assert not escaped, "\n".join(escaped)
    assert not loaded_retyped, "a field of another JSON type was accepted:\n" + "\n".join(loaded_retyped)
    resign(data)
    assert isinstance(outcome_of_data(data), PlanTable)  # every mutation was undone


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b, p: b["plans"][p].update(block_q=0),
         r"table\.plans\..*\.block_q is 0 \(an int\), expected an int >= 1"),
        (lambda b, p: b["plans"][p].update(persistent="false"), r"\.persistent is false \(a string\), expected true"),
        (lambda b, p: b["plans"][p]["kernel"].update(stages=None), r"\.kernel\.stages is null, expected an int"),
        (lambda b, p: b["plans"][p].pop("traversal"), r"table\.plans\..*\.traversal is missing"),
        (lambda b, p: b.update(keys=[]), r"table\.keys is a list, expected an object"),
        (lambda b, p: b["catalog"].update(kernels={}), r"table\.catalog\.kernels is an object, expected a list"),
        (lambda b, p: b["features"].update(stats=[1]), r"table\.features\.stats\[0\] is 1 \(an int\), expected a str"),
        (lambda b, p: next(iter(b["keys"].values())).update(cases=True),
         r"\.cases is true \(a bool\), expected an int"),
        (lambda b, p: b["provenance"].update(kernel_sources=[["a"]]), r"kernel_sources is a list, expected a hash"),
        (lambda b, p: first_regime(b).update(fit_regret=10**400), r"fit_regret 1000.* \(an int\) is not a number >= 1"),
        (lambda b, p: first_regime(b)["ranking"].__setitem__(0, "x"), r"ranking entry 0 is x \(a string\), expected a"),
    ],
    ids=["zero", "flag", "null", "missing", "keys", "kernels", "stat", "bool", "sources", "huge", "entry"],
)
def test_wrong_typed_fields_name_the_field(edit, message):
    data = json.loads(SHIPPED_TEXT)
    edit(data["table"], next(iter(data["table"]["plans"])))
    with pytest.raises(PlanTableError, match=message):
        PlanTable.from_dict(resign(data), source="plan_table_sm90.json")


def first_regime(body: dict) -> dict:
    return next(iter(next(iter(body["keys"].values()))["buckets"].values()))["regimes"][0]


def test_renamed_members(tmp_path):
    data = json.loads(SHIPPED_TEXT)
    body = data["table"]
    key = next(iter(body["keys"]))
    contents = []
    for new_name in ["", "x,y", "9,9", "-1,0", "1", "1,2,3", "9" * 5000 + ",0"]:
        buckets = body["keys"][key]["buckets"]
        old_name = next(iter(buckets))
        buckets[new_name] = buckets.pop(old_name)
        contents.append(json.dumps(resign(data)).encode())
        buckets[old_name] = buckets.pop(new_name)
    for new_key in ["", "cpu/" + key, key.split("/", 1)[1]]:
        body["keys"][new_key] = body["keys"].pop(key)
        contents.append(json.dumps(resign(data)).encode())
        body["keys"][key] = body["keys"].pop(new_key)
    outcomes = check_files(tmp_path, contents)
    assert all(isinstance(o, PlanTableError) for o in outcomes)


# -- the size cap ----------------------------------------------------------------------------------

@contextlib.contextmanager
def peak_allocation() -> Iterator[list[int]]:
    """The peak of Python allocations inside the block (bytes), in the list it yields."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    peak = [0]
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def test_a_file_over_the_cap_is_refused_unread(tmp_path, monkeypatch):
    padded = tmp_path / "padded.json"
    padded.write_bytes(SHIPPED_BYTES + b" " * (4 << 20))  # valid JSON: trailing white space
    assert load_plan_table(padded).arch == "sm90"
    monkeypatch.setattr(plan_table, "MAX_TABLE_BYTES", 1 << 10)
    with peak_allocation() as peak, pytest.raises(PlanTableError, match="larger than MAX_TABLE_BYTES"):
        load_plan_table(padded)
    assert peak[0] < (256 << 10)  # neither the 4 MiB nor the 76 KB table was read


def test_a_sparse_file_past_the_default_cap_is_refused_unread(tmp_path):
    huge = tmp_path / "huge.json"
    with huge.open("wb") as file:
        file.truncate(plan_table.MAX_TABLE_BYTES + 1)  # sparse: no disk, a size past the cap
    with peak_allocation() as peak, pytest.raises(PlanTableError, match="larger than MAX_TABLE_BYTES"):
        load_plan_table(huge)
    assert peak[0] < (256 << 10)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs a /proc file (Linux)")
def test_a_file_whose_size_the_stat_hides_is_read_up_to_the_cap(monkeypatch):
    """/proc files stat at 0 bytes: the read itself stops one byte past the cap."""
    monkeypatch.setattr(plan_table, "MAX_TABLE_BYTES", 64)
    with pytest.raises(PlanTableError, match="larger than MAX_TABLE_BYTES"):
        load_plan_table("/proc/self/maps")


def test_a_path_that_is_not_a_regular_file(tmp_path):
    with pytest.raises(PlanTableError, match="not a regular file"):
        load_plan_table(tmp_path)
    assert load_table_file(str(tmp_path / "absent.json")).error is None  # no file is no table, not an error


# -- through the environment variable: warned, the cost model, every call ------------------------

def bad_tables() -> dict[str, bytes]:
    data = json.loads(SHIPPED_TEXT)
    data["table"]["plans"][next(iter(data["table"]["plans"]))]["block_q"] = 0  # naming the plan divides by it
    provenance = json.loads(SHIPPED_TEXT)
    provenance["table"]["provenance"]["kernel_sources"] = 5
    return {
        "not-utf8": b"\xff" + SHIPPED_BYTES,
        "deep": b"[" * 100_000,
        "huge-int": SHIPPED_BYTES.replace(b'"schema_version": 2', b'"schema_version": ' + b"9" * 5000),
        "inf": SHIPPED_BYTES.replace(b'"schema_version": 2', b'"schema_version": 1e999'),
        "zero-block": json.dumps(resign(data)).encode(),
        "sources": json.dumps(resign(provenance)).encode(),
        "truncated": SHIPPED_BYTES[: len(SHIPPED_BYTES) // 3],
    }


@pytest.mark.parametrize("kind", list(bad_tables()))
def test_a_bad_table_in_the_environment_warns_and_attention_still_runs(tmp_path, monkeypatch, kind):
    raw = bad_tables()[kind]
    path = tmp_path / "plan_table_cpu.json"
    path.write_bytes(raw)
    assert load_table_file(str(path)).error is not None
    monkeypatch.setenv(TABLE_ENV, str(path))
    q, k, v = random_qkv(1, 96, 96, 2, 32, torch.float32, "cpu", seed=5)
    mask = random_mask(1, 2, 96, 96, 32, 16, density=0.4, seed=6)
    for _ in range(2):  # each call (a fresh Runtime) warns and falls back: nothing is left broken
        with pytest.warns(UserWarning, match=f"PlanTableError: {re.escape(str(path))}"):
            out = block_sparse_attention(q, k, v, mask)
        assert check_against_reference(out, None, q, k, v, mask).ok()
