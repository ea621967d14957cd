"""FP8 flag checks that only the command line can make (the recipe and block-size checks are TransformerConfig's,
reported in flag terms): a scaling recipe given without an FP8 format, which would otherwise train silently in the
high precision, and the ``custom`` recipe, which is not built."""

_DEFAULT_RECIPE = "delayed"


def validate_fp8_args(args) -> None:
    recipe = getattr(args, "fp8_recipe", _DEFAULT_RECIPE)
    if recipe == "custom":
        raise ValueError(
            "not supported yet: custom FP8 recipes (--fp8-recipe custom with --fp8-quantizer-factory); choose "
            "--fp8-recipe tensorwise, delayed, mxfp8 or blockwise"
        )
    if getattr(args, "fp8", None) is None and recipe != _DEFAULT_RECIPE:
        raise ValueError(
            f"--fp8-recipe {recipe} has no effect without --fp8-format: add --fp8-format hybrid (E5M2 gradients) "
            "or --fp8-format e4m3 to train in FP8, or drop --fp8-recipe"
        )
