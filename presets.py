"""What a run is: the model's Config, how it is trained (Sec. 4.2), the knobs of
kernels.py, and the named presets.

  config = PRESETS["tiny"].replace(steps=12000)   # a RunConfig: every field is a train.py flag
  ops = kernels.fast(config.memory_chunk, config.attention)
"""

import dataclasses
import math

import memorizing_transformer as mt
from memorizing_transformer import check


POSITIVE_FIELDS = mt.POSITIVE_FIELDS + ("batch_size", "grad_accum", "steps", "memory_chunk")
CHOICES = {**mt.CHOICES, "attention": ("explicit", "fused")}


@dataclasses.dataclass(frozen=True)
class RunConfig(mt.Config):
    """The model's fields (memorizing_transformer.Config), then training's and the kernels'."""

    # training (Sec. 4.2)
    batch_size: int = 256  # rows; a batch holds batch_size * segment_length tokens
    grad_accum: int = 1  # micro-batches per step (rows are split between them)
    steps: int = 500_000
    lr: float = 1.0
    warmup_steps: int = 1000
    seed: int = 0
    # kernels.py's knobs
    memory_chunk: int = 1024  # kernels.memory_search scores the memory this many slots at a time
    attention: str = "explicit"  # kernels.py's local attention: "explicit" or "fused" (cuDNN)

    def __post_init__(self):
        super().__post_init__()
        for name in POSITIVE_FIELDS:
            value = getattr(self, name)
            positive = isinstance(value, int) and value > 0
            check(positive, f"{name} must be a positive integer, got {value!r}.")
        value = self.attention
        check(
            value in CHOICES["attention"],
            f"attention must be one of {CHOICES['attention']}, got {value!r}.",
        )
        check(math.isfinite(self.lr), f"lr must be finite, got {self.lr}.")
        check(
            self.batch_size % self.grad_accum == 0,
            f"batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum}).",
        )
        check(
            self.lr > 0 and self.warmup_steps >= 0,
            f"lr must be > 0 and warmup_steps >= 0, got {self.lr}, {self.warmup_steps}.",
        )
        check(0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}.")


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
    # The synthetic task's recipe (README): two layers, so that the copy circuit's
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
# A 2-core CPU, minutes: the real-text recipe whose memory helps most (README, "Real text").
PRESETS["tiny"] = PRESETS["synthetic"].replace(steps=5000)
