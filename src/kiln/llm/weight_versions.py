"""vLLM's weight versions (RL): a label for the weights an engine runs, set by the trainer
(``POST /update_weight_version``, ``LLM.update_weight_version``) and reported back per
finished sample as spans of its output tokens, ``[start, end)`` each sampled under one
version (``weight_versions`` of ``/inference/v1/generate`` and of offline outputs).

The engine keeps, per sequence, the output-token index where each version began; it sends
that list with an output only when it changed (a sequence's first output, and after a new
version), never per token. A version that produced no token leaves no span, as in vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sequence import Sequence

#: vLLM's label of the weights an engine starts with
DEFAULT_VERSION = "default"
#: a version longer than this is refused (vLLM sets no limit; every output carries it)
MAX_VERSION_LENGTH = 256
#: why vLLM's weight transfer (``init_weight_transfer_engine``, ``update_weights``, ...)
#: is refused
NO_TRANSFER = (
    "kiln has no weight transfer engine (vLLM's NCCL or CUDA IPC backends, "
    "--weight-transfer-config): load new weights as a new model version "
    "(POST /v2/repository/models/NAME/load) or restart on them; update_weight_version "
    "labels the weights"
)


def begin(seq: Sequence, version: str) -> None:
    """A new sequence's tokens start under ``version``."""
    seq.weight_version_starts = [(version, 0)]
    seq.weight_versions_changed = True


def switch(seq: Sequence, version: str) -> None:
    """The engine's weights are ``version`` from the sequence's next token on."""
    starts = seq.weight_version_starts
    at = seq.num_output_tokens
    if starts and starts[-1][1] == at:  # the last version sampled nothing: no span
        starts.pop()
    if starts and starts[-1][0] == version:
        seq.weight_versions_changed = True
        return
    starts.append((version, at))
    seq.weight_versions_changed = True


def spans(starts: list[tuple[str, int]] | None, num_tokens: int) -> list[dict[str, Any]] | None:
    """vLLM's ``WeightVersionSpan`` list of a sample with ``num_tokens`` output tokens;
    None when no version was reported for it."""
    if starts is None:
        return None
    kept = [(v, s) for v, s in starts if s < num_tokens]
    ends = [s for _, s in kept[1:]] + [num_tokens] if kept else []
    return [{"version": v, "start": s, "end": e} for (v, s), e in zip(kept, ends, strict=True)]


def check_version(version: object, field: str) -> str:
    """A version from a client: a string of at most ``MAX_VERSION_LENGTH`` characters."""
    if not isinstance(version, str):
        raise ValueError(f"'{field}' must be a string")
    if len(version) > MAX_VERSION_LENGTH:
        raise ValueError(
            f"'{field}' is {len(version)} characters long: at most {MAX_VERSION_LENGTH}"
        )
    return version


class OfflineWeightVersions:
    """vLLM's ``LLM`` methods of weight versions (``RLOfflineMixin``); the transfer ones
    raise ``NotImplementedError`` (``NO_TRANSFER``)."""

    engine: LLMEngine

    def update_weight_version(self, new_version: str) -> None:
        """Label the weights the next steps run (without changing them)."""
        self.engine.set_weight_version(check_version(new_version, "new_version"))

    def get_weight_version(self) -> str:
        return self.engine.weight_version

    def init_weight_transfer_engine(self, request: object) -> None:
        raise NotImplementedError(NO_TRANSFER)

    def shutdown_weight_transfer_engine(self) -> None:
        raise NotImplementedError(NO_TRANSFER)

    def start_weight_update(self) -> None:
        raise NotImplementedError(NO_TRANSFER)

    def start_draft_weight_update(self) -> None:
        raise NotImplementedError(NO_TRANSFER)

    def update_weights(self, request: object) -> None:
        raise NotImplementedError(NO_TRANSFER)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise NotImplementedError(NO_TRANSFER)
