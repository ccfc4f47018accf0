"""What a run is: the model's Config, how it is trained (Sec. 4.2), the knobs of
kernels.py, and the named presets.

  config = PRESETS["tiny"].replace(steps=12000)   # a RunConfig: every field is a train.py flag
  ops = kernels.of(config)   # mt.PLAIN where config.ops is "plain", else kernels.py's
"""

import dataclasses

import memorizing_transformer as mt
from memorizing_transformer import check, knob


seed_rule = mt.rule(lambda x: mt.is_int(x) and 0 <= x < 2**32, "an integer in [0, 2**32)")
positive_number = mt.rule(lambda x: mt.is_number(x) and x > 0, "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class RunConfig(mt.Config):
    """The model's fields (memorizing_transformer.Config), then training's and
    the kernels'. Each is a train.py flag, as Config's are."""

    # training (Sec. 4.2)
    batch_size: int = knob(256, mt.positive, "batch rows; each row streams documents in order")
    grad_accum: int = knob(1, mt.positive, "micro-batches per step (rows are split between them)")
    steps: int = knob(
        500_000, mt.positive,
        "training steps; with --resume, the step to train to; with --init-from, the steps to add",
    )
    lr: float = knob(1.0, positive_number, "base learning rate (1.0 in the paper)")
    warmup_steps: int = knob(1000, mt.count, "linear warmup steps before square-root decay")
    cross_batch_ramp: int = knob(
        0, mt.count,
        "steps over which cross_batch's d grows from 1, a row at a time in equal stages (0: d "
        "from the first step)",
    )
    seed: int = knob(
        0, seed_rule,
        "seed of the initialization and of the order in which rows take training documents; the "
        "split is fixed (seed 0), so every seed is scored on the same documents",
    )
    # kernels.py's knobs
    memory_chunk: int = knob(
        1024, mt.positive, "memory slots kernels.py scores at a time (the [T, M] scores in pieces)"
    )
    ops: str = knob(
        "fast", mt.one_of("fast", "plain"),
        "the model's pieces: kernels.py's faster drop-ins, or memorizing_transformer.py's own",
    )
    attention: str = knob(
        "explicit", mt.one_of("explicit", "fused"),
        "local attention: explicit einsums, or fused (jax.nn.dot_product_attention: cuDNN's on a "
        "GPU with bfloat16), the same math for the valid tokens",
    )

    def __post_init__(self):
        super().__post_init__()
        check(
            self.batch_size % self.grad_accum == 0,
            f"batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum}).",
        )
        rows = self.batch_size // self.grad_accum
        check(
            self.cross_batch <= rows,
            f"cross_batch ({self.cross_batch}) must be at most the {rows} rows of a micro-batch.",
        )
        check(
            not self.cross_batch_ramp or self.cross_batch > 1,
            f"cross_batch_ramp ({self.cross_batch_ramp}) needs a cross_batch above 1 to grow to.",
        )


def cross_batch_at(config, step):
    """d, the rows each row's search covers, in training step `step` (0-based): with a ramp of
    R steps, 1 for the first R / d steps, 2 for the next R / d, and so on, then d from step R
    on, so that the layer first learns to use its memory and then to tell it from others'."""
    d, ramp = config.cross_batch, config.cross_batch_ramp
    if not ramp or step >= ramp:
        return d
    return 1 + step * d // ramp


PRESETS = {
    # Sec. 4.2: 2^17 tokens a step, as 8 micro-batches of 32 rows; 8192 slots scored at a time.
    "paper": RunConfig(grad_accum=8, memory_chunk=8192),
    # One GPU, a few minutes.
    "small": RunConfig(
        vocab_size=8192,
        d_model=512,
        num_layers=8,
        num_heads=8,
        head_dim=64,
        d_ff=2048,
        segment_length=512,
        memory_layers=(5,),
        memory_size=2048,
        batch_size=32,
        steps=5000,
        warmup_steps=500,
    ),
    # The synthetic task's recipe (docs/results.md): two layers, so that the copy circuit's
    # second half can only live in the memory layer; a previous-token prior; a
    # rate too low to learn bindings.
    "synthetic": RunConfig(
        vocab_size=2048,
        d_model=128,
        num_layers=2,
        num_heads=4,
        head_dim=32,
        d_ff=512,
        segment_length=128,
        memory_layers=(1,),
        memory_size=512,
        batch_size=8,
        steps=2000,
        warmup_steps=100,
        lr=0.3,
        init_prev_token_bias=6.0,
    ),
}
# A 2-core CPU, minutes: the real-text recipe whose memory helps most (README, "Results").
PRESETS["tiny"] = PRESETS["synthetic"].replace(steps=5000)
