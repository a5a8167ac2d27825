"""Average pooling (the mean of uint8 values is requantized to the output's own range)."""

RULES = {
    "AveragePool": dict(kind="compute", act_inputs=lambda n: [0]),
    "GlobalAveragePool": dict(kind="compute", act_inputs=lambda n: [0]),
}
