"""A catalogue entry as the three command lines a user would type: `qtool calibrate`, `qtool quantize`,
`qtool eval`, in the model's working folder. The options of a step are the command's own, named as on
its command line (`exclude-sensitive = true`, `method = "minmax"`, `exclude = ["/fc/Gemm"]`), so the
batch declares none of them again; each line is parsed by the command itself when it is made (before
any job starts), so a wrong name or value is one line naming the model, and nothing runs. (Here, in the
CLI's layer, because it reads the commands; qtool.batch receives the lines as data.)
"""
from __future__ import annotations

import os

import click

from qtool.batch.catalogue import Entry
from qtool.batch.job import EVAL_JSON
from qtool.errors import UsageError

# parameters the batch sets itself (paths, the working folder, the output's verbosity, where work runs):
# not a catalogue's
_ALWAYS = {"workdir", "json_path", "quiet", "verbose", "debug", "ray"}
RESERVED = {"calibrate": _ALWAYS | {"model", "data", "config"},
            "quantize": _ALWAYS | {"output", "model", "table"},
            "eval": _ALWAYS | {"data", "model", "int8_path"}}


def commands() -> dict:
    """step -> its click command (imported here: `qtool calibrate` alone need not import this)."""
    from qtool.commands import calibrate, eval as eval_, quantize
    return {"calibrate": calibrate.command, "quantize": quantize.command, "eval": eval_.command}


def lines(entry: Entry, workdir: str) -> tuple:
    """((step, argv after `qtool`), ...) for the entry, its working folder `workdir`, each argv parsed by
    its command; a problem is one UsageError naming the model."""
    cmds = commands()
    try:
        opts = {step: option_args(cmds[step], step, entry.options.get(step, {})) for step in cmds}
        calibrate = ["--model", entry.path, "--data", entry.data] + (["--config", entry.config] if entry.config else [])
        evaluate = (["--data", entry.eval_data] if entry.eval_data else []) + ["--json", os.path.join(workdir, EVAL_JSON)]
        out = (("calibrate", ["calibrate"] + calibrate + opts["calibrate"] + ["-w", workdir, "-q"]),
               ("quantize", ["quantize"] + opts["quantize"] + ["-w", workdir, "-q"]),
               ("eval", ["eval"] + evaluate + opts["eval"] + ["-w", workdir, "-q"]))
        for step, argv in out:
            cmds[step].make_context(step, argv[1:], resilient_parsing=False)
    except (click.UsageError, UsageError) as err:
        msg = err.format_message() if isinstance(err, click.ClickException) else str(err)
        raise UsageError(f"model {entry.name!r}: {' '.join(msg.split())}") from None
    return out


def option_args(command: click.Command, step: str, options: dict) -> list:
    """The command-line arguments of `options` ({long option name: value}) for `command`."""
    params = {}
    for p in command.params:
        if isinstance(p, click.Option):
            for opt in p.opts:
                if opt.startswith("--"):
                    params[opt[2:]] = p
    args = []
    for key, value in options.items():
        p = params.get(str(key).replace("_", "-"))
        if p is None or p.name in RESERVED[step]:
            why = "set by qtool batch" if p is not None else "no such option"
            raise UsageError(f"[{step}] {key!r}: {why} (the options of `qtool {step} --help`, without the dashes)")
        args += _args(p, step, key, value)
    return args


def _args(p: click.Option, step: str, key: str, value) -> list:
    flag = next(o for o in p.opts if o.startswith("--"))
    if p.is_flag:
        if not isinstance(value, bool):
            raise UsageError(f"[{step}] {key!r} is a switch: true or false, not {value!r}")
        if p.secondary_opts:
            return [flag if value else p.secondary_opts[0]]
        if not value and p.default:
            raise UsageError(f"[{step}] {key!r} cannot be turned off")
        return [flag] if value else []
    values = value if isinstance(value, list) else [value]
    if (len(values) != 1 and not p.multiple) or not all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
        raise UsageError(f"[{step}] {key!r} takes {'values' if p.multiple else 'one value'} "
                         f"(a string or a number), not {value!r}")
    return [a for v in values for a in (flag, str(v))]
