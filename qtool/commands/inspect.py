"""qtool inspect: what qtool will do with each op of a model, before any calibration."""
from __future__ import annotations

import click

from qtool import outputs
from qtool.commands.common import output_options, say, setup_output, write_json


@click.command("inspect", short_help="What qtool will do with each op of a model, before calibrating.")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--shape", "shapes", multiple=True, help="Input shape for counting MACs where the model's is dynamic: "
              "NAME=1,3,H,W (or just 1,3,H,W for a one-input model; repeatable).")
@click.option("--exclude", multiple=True, help="Plan as if this node were kept fp32 (as `quantize --exclude`).")
@click.option("--all", "all_nodes", is_flag=True, help="List every node's name, not only fp32 ones.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the inspection as JSON here.")
@output_options
def command(model, shapes, exclude, all_nodes, json_path, quiet, verbose, debug):
    """Opset, inputs and outputs, parameters and MACs, and per op: int8, passed through
    in int8, fused, or kept fp32 and why. Node names are the ones --exclude takes.

    \b
    Example:
      qtool inspect ../shared/models/ppocr-cls-mobilenetv3.onnx --shape x=1,3,48,192
    """
    setup_output(quiet, verbose)
    if json_path:  # (before the model is read: a 1,000,000-node model takes a while)
        outputs.check(writes=[outputs.File("--json file", json_path)], reads=outputs.model("model", model))
    from qtool.inspect import inspect_model, render  # (here: the other commands need not import it)

    r = inspect_model(model, list(shapes), {n: "excluded by the user (--exclude)" for n in exclude})
    say(quiet, render(r, all_nodes or verbose > 0))
    write_json(json_path, r.to_dict())
