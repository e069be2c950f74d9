"""Deliberate kernel bugs, as a kernel developer would make them: each one an edit of a C source
under ``ipubuild/kernels/``, and the operation the numerical test must name when it fails.

Used by ``tests/test_numerics_mutations.py`` (each must fail the build, naming its operation) and
by ``benchmarks/numerics.py`` (what each does to the gates' figures).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str               # under ipubuild/kernels/
    old: str                # replaced, exactly once
    new: str
    op: str                 # the operation named first, in the ViT graph (its type, if `by_type`)
    kernel: str             # the kernel variant named (a prefix)
    by_type: bool = False

    def apply(self, tree: Path) -> str:
        """Edit the tree's copy of the kernel source; return its text before the edit."""
        path = Path(tree) / "ipubuild" / "kernels" / self.file
        text = path.read_text()
        if text.count(self.old) != 1:
            raise AssertionError(f"mutation {self.name}: {self.old!r} is not in {self.file} exactly once")
        path.write_text(text.replace(self.old, self.new))
        return text

    def revert(self, tree: Path, text: str) -> None:
        (Path(tree) / "ipubuild" / "kernels" / self.file).write_text(text)


MUTATIONS = [
    Mutation("gelu_coefficient", "the GELU's 0.5 becomes 0.45", "ipu_kernel.h",
             "return 0.5f * v * (1.0f + tanhf", "return 0.45f * v * (1.0f + tanhf", "gelu", "gelu_f32", by_type=True),
    Mutation("layernorm_epsilon", "layer norm's epsilon multiplied by 100", "layernorm.c",
             "const float eps = ipu_f32_from_bits(args[6]);", "const float eps = ipu_f32_from_bits(args[6]) * 100.0f;",
             "layernorm", "layernorm_f32", by_type=True),
    Mutation("matmul_bias_dropped", "the matmul forgets its bias", "matmul.c",
             "if (bias)\n                        v += ipu_ld_f32(bias + 4u * j);", "(void)bias;",
             "patch_embed", "matmul_"),
    Mutation("fp8_cast_truncates", "the FP8 encoder truncates instead of rounding to nearest even",
             "ipu_kernel.h", "(uint32_t)ipu_rne_shift(sig, (unsigned)shift);", "(uint32_t)(sig >> shift);",
             "patchify", "cast_rows_f32_f143"),
    Mutation("add_loop_off_by_one", "the add's column loop stops one short", "add.c",
             "for (uint32_t j = 0; j < cols; j++) {", "for (uint32_t j = 0; j + 1 < cols; j++) {",
             "pos_embed", "add_f32"),
    Mutation("row_copy_wrong_stride", "the strided row copy (patchify's cast_rows) steps through its source at "
             "the destination's stride", "cast.c",
             "convert(src + r * args[5], dst + r * args[6], cols, scale);",
             "convert(src + r * args[6], dst + r * args[6], cols, scale);", "patchify", "cast_rows_f32_f143"),
    Mutation("softmax_sum_skips_first", "the softmax's sum leaves out each row's first exponential", "softmax.c",
             "            sum += e;", "            sum += j ? e : 0.0f;", "block0.softmax", "softmax_f32"),
]
