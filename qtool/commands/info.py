"""qtool info: versions, the kernel ISA in use and the CPU features it was chosen from."""
from __future__ import annotations

import platform

import click

from qtool.commands.common import echo, output_options, setup_output


def gather() -> dict:
    import numpy
    import onnx

    import qtool
    d = {"qtool": qtool.__version__, "python": platform.python_version(), "numpy": numpy.__version__,
         "onnx": onnx.__version__, "machine": platform.machine()}
    from qtool.runtime.backend import cpu_name
    d["cpu"] = cpu_name()
    try:
        import onnxruntime
        d["onnxruntime"] = onnxruntime.__version__
        from qtool.ort_arithmetic import ort_int8_arithmetic
        d["ort_int8_arithmetic"] = ort_int8_arithmetic()
    except ImportError:
        d["onnxruntime"] = None
    try:
        import qtool.kernels as K
        d["kernels"] = K.info()
        d["pool"] = K.pool_wakeup()
    except Exception as e:  # not built: say so rather than fail
        d["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    return d


@click.command("info", short_help="Version, the kernel ISA chosen and the CPU features behind it.")
@click.option("--json", "as_json", is_flag=True, help="Print the same facts as JSON.")
@output_options
def command(as_json, quiet, verbose, debug):
    """Print qtool's version, the int8 kernel ISA chosen, the CPU features behind it and ORT's version.

    \b
    Example:
      qtool info
      QTOOL_ISA=avx2 qtool info      # what a forced lower ISA would use
    """
    setup_output(quiet, verbose)
    d = gather()
    if quiet and not as_json:
        return
    if as_json:
        import json
        echo(json.dumps(d, indent=2, default=str))
        return
    k = d["kernels"]
    echo(f"qtool {d['qtool']} (python {d['python']}, numpy {d['numpy']}, onnx {d['onnx']}, {d['machine']})")
    echo(f"cpu: {d['cpu']}")
    echo(f"onnxruntime {d['onnxruntime'] or 'not installed'}")
    if d.get("ort_int8_arithmetic"):
        from qtool.ort_arithmetic import describe
        echo(f"onnxruntime int8 on this CPU: {describe(d['ort_int8_arithmetic'])}")
    if "error" in k:
        echo(f"kernels: not available ({k['error']}); the runtime falls back to numpy")
        return
    echo(f"kernel ISA: {k.get('isa')} (best this CPU supports: {k.get('best_isa')}), threads: {k.get('num_threads')}")
    sup = k.get("supported", {})
    if sup:
        echo("CPU features: " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in sup.items()))
    kern = k.get("kernels", {})
    if kern:
        echo("kernels: " + ", ".join(f"{op}={name}" for op, name in kern.items()))
    p = d.get("pool")
    if p:
        echo(f"thread pool: idle workers spin {p['spin_us']:.0f} us, then sleep (a pause takes {p['pause_ns']:.0f} ns here)")
        if p["wake_from_sleep_us"] is None:
            echo("worker wake-up: no workers (1 thread)")
        else:
            echo(f"worker wake-up (post to start, median / max of {p['samples']}): asleep "
                       f"{p['wake_from_sleep_us']:.1f} / {p['wake_from_sleep_max_us']:.1f} us, spinning "
                       f"{p['wake_while_spinning_us']:.2f} / {p['wake_while_spinning_max_us']:.2f} us")
