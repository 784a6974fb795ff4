"""Diagnostic kernel variants (timing only, some publish incorrectly): python3 patch.py V..."""
import sys
p = "tpfuse/kernels/signals.py"
s = open(p).read()
for v in sys.argv[1:]:
    if v == "nowait":      # no wait for the TMA writes / proxy fence before a count
        old = r'"cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;"'
        new = r'"mov.u32 $0, 0;"'
    elif v == "noproxy":   # wait for the writes, no proxy fence
        old = r'"cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;"'
        new = r'"cp.async.bulk.wait_group 0;\n\tmov.u32 $0, 0;"'
    elif v == "nobar":     # no CTA barrier
        old = r'tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;"'
        new = r'tl.inline_asm_elementwise("mov.u32 $0, 0;"'
    elif v == "relaxed":   # the count without its release (no MEMBAR.GPU)
        old = "@me red.release.gpu.global.add.u32"
        new = "@me red.relaxed.gpu.global.add.u32"
    elif v == "nopoll":    # pollers never read in the loop
        old = r'"@me ld.global.u64 $1, [$4];\n\t@me ld.relaxed.gpu.global.u32 $0, [$3];\n\t}"'
        new = r'"}"'
    else:
        raise SystemExit(f"unknown variant {v}")
    assert s.count(old) == 1, (v, s.count(old))
    s = s.replace(old, new)
open(p, "w").write(s)
