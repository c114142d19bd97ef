"""The model class of each ``config.json`` architecture kiln runs."""

from __future__ import annotations

from kiln.core.errors import KilnError, Status
from kiln.llm.config import SUPPORTED_ARCHITECTURES, ModelArgs
from kiln.llm.models.llama import LlamaForCausalLM


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    # imported here: each module pulls in only what its architecture needs
    from kiln.llm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
    from kiln.llm.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
    from kiln.llm.models.phi3 import Phi3ForCausalLM
    from kiln.llm.models.qwen3 import Qwen3ForCausalLM

    classes: dict[str, type[LlamaForCausalLM]] = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "Gemma2ForCausalLM": Gemma2ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
    }
    assert set(classes) == set(SUPPORTED_ARCHITECTURES), "config.py and the registry agree"
    if architecture not in classes:
        raise KilnError(
            f"llm backend: architecture '{architecture}' is not supported "
            f"(kiln runs {', '.join(SUPPORTED_ARCHITECTURES)})",
            Status.INVALID_ARG,
        )
    return classes[architecture]


def build_model(args: ModelArgs, max_positions: int) -> LlamaForCausalLM:
    """The forward pass of ``args.architecture`` (its weights not loaded yet)."""
    return model_class(args.architecture)(args, max_positions)
