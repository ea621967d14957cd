from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: F401
    TextGenerationController,
)
