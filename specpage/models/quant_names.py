"""The quantization settings a user names (torch-free, so the config can
check them): ``none``, ``q4`` (int4, group 32; ``q4-g64``, ``q4-g128``),
``q8`` (refused, see Q8_REFUSED) and ``auto``. What each does is in
specpage.models.quant_load."""

from __future__ import annotations

from dataclasses import dataclass

from specpage.models.config import ModelLoadError

QUANTIZATIONS = ("none", "q4", "q4-g64", "q4-g128", "q8", "auto")
DEFAULT_GROUP = 32  # the group of GGUF's Q4_0/Q4_1 blocks, and gpt-fast's smallest
Q8_REFUSED = (
    "quantization q8 is not offered: torch's CPU int8 weight-only kernel "
    "(_weight_int8pack_mm, one scale per row) was slower than q4 in every run here and "
    "not consistently faster than fp32 at batch 32 (bench/quantization.py, linears_alone); "
    "use q4 or none"
)


class QuantizationError(ModelLoadError, ValueError):
    """A quantization setting, or a weight, that cannot be quantized as
    asked; the message names it."""


def check_tensor_parallel(applied: str, world: int) -> None:
    """Tensor parallelism shards dense weights (specpage.executor.parallel): a
    quantized target is refused there, by name, rather than failing deep in
    the sharding."""
    if world > 1 and applied != "none":
        raise QuantizationError(f"tensor_parallel_size {world} shards dense weights only; the "
                                f"target is quantized ({applied}): use quantization none")


@dataclass(frozen=True)
class Quantization:
    kind: str  # "none" | "q4" | "auto"
    group: int = DEFAULT_GROUP

    @staticmethod
    def parse(name: str | None) -> Quantization:
        """None is "none". Raises QuantizationError naming a bad name."""
        name = "none" if name is None else name
        if name not in QUANTIZATIONS:
            raise QuantizationError(f"unknown quantization {name!r}; known: "
                                    f"{', '.join(QUANTIZATIONS)}")
        if name == "q8":
            raise QuantizationError(Q8_REFUSED)
        if name.startswith("q4-g"):
            return Quantization("q4", int(name.removeprefix("q4-g")))
        return Quantization(name)
