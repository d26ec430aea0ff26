def build_native_library(out_dir, log=print):
    log("native build not implemented yet", 2)
