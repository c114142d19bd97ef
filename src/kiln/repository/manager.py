"""The model repository: scan, version policy, control modes, load/unload lifecycle.

A load of a model that is already serving brings every new version up first, then swaps
the serving map in one step, then drains and closes the old runtimes: no request sees a
gap. A failed reload leaves the old versions serving.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from kiln.backends.base import Backend
from kiln.backends.registry import backend_class, backend_name, platform_for
from kiln.config.ensemble_graph import is_ensemble
from kiln.config.loader import (
    JSON_OVERRIDE_PATH,
    ConfigError,
    config_from_json,
    load_config_file,
    validate_config,
)
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status, invalid_arg, not_found
from kiln.repository.load_files import DEFAULT_LOAD_FILE_BYTES, FileBudget, materialise
from kiln.repository.safety import check_config_paths, check_model_name, check_tree_inside
from kiln.repository.source import Fingerprint, LocalSource, RepositoryError, RepositorySource

# The ensembles whose load is waiting on this one (outermost first): a composing model that
# is already among them would wait on its own lock, so it is refused as a cycle instead.
_LOADING_ENSEMBLES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "kiln_loading_ensembles", default=()
)

log = logging.getLogger(__name__)

CONFIG_NAME = "config.pbtxt"
#: a version in a request: a signed 64-bit integer, ASCII digits
_VERSION = re.compile(r"-?[0-9]{1,18}")


class ModelState(enum.Enum):
    UNKNOWN = "UNKNOWN"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


class Runtime(Protocol):
    """What the repository needs of one loaded model version (``ModelRuntime``)."""

    version: int
    state: ModelState
    reason: str

    @property
    def ready(self) -> bool: ...

    async def load(self) -> None: ...

    async def unload(self, timeout: float) -> None: ...


R = TypeVar("R", bound=Runtime)
# (name, version, config, version folder, backend class, resolve) -> a runtime, not loaded
# yet; ``resolve`` looks a composing model up (ensembles). Given by the server: the
# repository sits below it and never imports it.
RuntimeFactory = Callable[[str, int, ModelConfig, Path, type[Backend], Callable[[str, str], R]], R]


def version_dirs(model_dir: Path) -> dict[int, Path]:
    """Numeric version folders; others (and leading zeros) are ignored, as in Triton."""
    found = {}
    for p in model_dir.iterdir():
        if p.is_dir() and p.name.isdigit() and (p.name == "0" or not p.name.startswith("0")):
            found[int(p.name)] = p
    return found


def select_versions(config: ModelConfig, available: list[int]) -> list[int]:
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return sorted(available)
    if which == "specific":
        wanted = set(policy.specific.versions)
        missing = sorted(wanted - set(available))
        if missing:
            raise invalid_arg(
                f"model '{config.name}': version_policy asks for versions {missing} which "
                "have no folder in the repository"
            )
        return sorted(wanted)
    count = policy.latest.num_versions if which == "latest" else 1
    return sorted(available)[-max(count, 1) :]


@dataclass
class ModelEntry(Generic[R]):
    name: str
    versions: dict[int, R] = field(default_factory=dict)
    config: ModelConfig | None = None
    state: ModelState = ModelState.UNKNOWN
    reason: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    files_dir: Path | None = None  # temp folder holding files sent with a load request
    # Loaded only because an ensemble needs it, not by its own name (Triton's "not
    # explicitly loaded"): unloading that ensemble with unload_dependents unloads it too.
    dependency: bool = False


class RepositoryManager(Generic[R]):
    def __init__(
        self,
        repositories: list[Path | RepositorySource],
        runtime_factory: RuntimeFactory[R],
        drain_timeout: float = 30.0,
        auto_complete: bool = True,
        served: list[ModelConfig] | None = None,
        config_check: Callable[[ModelConfig, list[int]], None] | None = None,
        max_load_file_bytes: int = DEFAULT_LOAD_FILE_BYTES,
    ) -> None:
        # Each --model-repository: a folder, or a bucket fetched into a local cache.
        self.sources: list[RepositorySource] = [
            LocalSource(r) if isinstance(r, Path) else r for r in repositories
        ]
        self.repositories = [s.path for s in self.sources if isinstance(s, LocalSource)]
        #: models given on the command line (``kiln serve --model``): a config built in
        #: memory whose ``model_path`` parameter names the checkpoint, no folder of its own
        self.served = {c.name: c for c in served or ()}
        # Triton's --disable-auto-complete-config: configs are taken as written (no inputs,
        # outputs or max_batch_size read from the model, no default dynamic batcher).
        self.auto_complete = auto_complete
        self.drain_timeout = drain_timeout
        self.runtime_factory = runtime_factory
        # the server's checks of what it reads from a config (a rollout policy against the
        # versions chosen): a failure fails the load and the old versions keep serving
        self.config_check = config_check
        self.entries: dict[str, ModelEntry[R]] = {}
        self._load_slots = asyncio.Semaphore(4)  # Triton's --model-load-thread-count
        #: decoded ``file:`` bytes of the loads in flight (--max-load-file-bytes)
        self.file_budget = FileBudget(max_load_file_bytes)

    # ---- discovery -------------------------------------------------------------------
    def model_names(self) -> list[str]:
        """Local folders: as they are now; buckets: as of their last listing; and the
        models given with ``--model``."""
        names: set[str] = set()
        for source in self.sources:
            names.update(source.model_names())
        return sorted(names | set(self.served))

    def refresh(self) -> None:
        """List every remote repository again (network I/O: call off the event loop)."""
        for source in self.sources:
            source.refresh()

    def fingerprints(self) -> dict[str, Fingerprint]:
        """Every model's fingerprint; a name in several repositories: the first one's
        (the folder a load takes). Raises ``RepositoryError`` when one cannot be read."""
        result: dict[str, Fingerprint] = {}
        for source in self.sources:
            for name, fp in source.fingerprints().items():
                result.setdefault(name, fp)
        return result

    def model_dir(self, name: str) -> Path:
        """The local folder of model ``name``: a bucket's model is fetched into the local
        cache first (network I/O: call off the event loop where a bucket may be read)."""
        check_model_name(name)
        for source in self.sources:
            try:
                found = source.locate(name)
            except RepositoryError as exc:
                raise KilnError(f"failed to load '{name}': {exc}", Status.UNAVAILABLE) from None
            if found is not None:
                return found
        raise not_found(
            f"failed to load '{name}', no version is available: no model folder "
            f"'{name}' in the model repository"
        )

    async def _model_dir(self, name: str) -> Path:
        return await asyncio.get_running_loop().run_in_executor(None, self.model_dir, name)

    # ---- lookup ----------------------------------------------------------------------
    def get(self, name: str, version: str = "") -> R:
        entry = self.entries.get(name)
        if entry is None or not entry.versions:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version:
            # ASCII digits only: int() also reads '+1', ' 1', other digits and '1_0' (as 10)
            if not _VERSION.fullmatch(version):
                raise invalid_arg(
                    f"invalid version '{version[:40]}' for model '{name}': must be an integer"
                )
            v = int(version)
            runtime = entry.versions.get(v)
            if runtime is None:
                raise not_found(f"Request for unknown model: '{name}' version {v} is not found")
            return runtime
        ready = [r for r in entry.versions.values() if r.ready]
        if not ready:
            raise KilnError(f"model '{name}' has no ready versions", Status.UNAVAILABLE)
        return max(ready, key=lambda r: r.version)

    def runtimes(self) -> list[R]:
        # Metrics, history and alert threads call this while the event loop loads models:
        # list(dict.values()) copies in one C call under the GIL, a generator would not.
        entries = list(self.entries.values())
        return [r for e in entries for r in list(e.versions.values())]

    # ---- load / unload ---------------------------------------------------------------
    async def load(
        self,
        name: str,
        config_json: str | None = None,
        files: dict[str, str | bytes] | None = None,
        *,
        dependency: bool = False,
    ) -> None:
        """Load (or reload) ``name``; ``dependency``: for an ensemble that needs it, not by
        its own name."""
        check_model_name(name)
        if name not in self.entries and not files and name not in self.served:
            # Fails for an unknown name before an entry exists: it leaves no index row behind.
            await self._model_dir(name)
        entry = self.entries.setdefault(name, ModelEntry[R](name))
        async with entry.lock, self._load_slots:
            try:
                await self._load(entry, config_json, files)
                entry.dependency = dependency
            except ConfigError as exc:
                self._fail(entry, str(exc))
                raise KilnError(f"failed to load '{name}': {exc}", Status.INVALID_ARG) from exc
            except KilnError as exc:
                self._fail(entry, exc.message)
                if not exc.message.startswith("failed to load"):
                    exc.message = f"failed to load '{name}': {exc.message}"
                raise
            except Exception as exc:
                log.exception("loading model '%s'", name)
                self._fail(entry, f"{type(exc).__name__}: {exc}")
                raise KilnError(
                    f"failed to load '{name}': {type(exc).__name__}: {exc}", Status.INTERNAL
                ) from exc

    def _fail(self, entry: ModelEntry[R], reason: str) -> None:
        if not entry.versions:  # a failed reload keeps the old versions serving
            entry.state = ModelState.UNAVAILABLE
        entry.reason = reason
        log.error("model '%s' failed to load: %s", entry.name, reason)

    async def _load(
        self,
        entry: ModelEntry[R],
        config_json: str | None,
        files: dict[str, str | bytes] | None,
    ) -> None:
        name = entry.name
        if not files and config_json is None and name in self.served:
            await self._load_served(entry, self.served[name])
            return
        if not files:
            model_dir = await self._model_dir(name)
            # model_dir is <resolved repository>/<name>: its parent is the repository.
            check_tree_inside(model_dir, model_dir.parent, name)
            await self._load_dir(entry, model_dir, config_json, None)
            return
        if config_json is None:
            raise invalid_arg(f"failed to load '{name}': 'file:' parameters need 'config'")
        files_dir = await materialise(name, files, self.file_budget)
        try:
            await self._load_dir(entry, files_dir, config_json, files_dir)
        except BaseException as exc:
            # Nothing else owns the folder unless the new versions took it: every failure
            # path removes it (it may hold a client's large files), and its private path
            # is not told to the client.
            if entry.files_dir != files_dir:
                shutil.rmtree(files_dir, ignore_errors=True)
            _hide_folder(exc, files_dir)
            raise

    async def _load_dir(
        self,
        entry: ModelEntry[R],
        model_dir: Path,
        config_json: str | None,
        files_dir: Path | None,
    ) -> None:
        name = entry.name
        config_path = model_dir / CONFIG_NAME
        text: str | None = None
        if config_json is not None:
            config = config_from_json(config_json)
        elif config_path.exists():
            config = load_config_file(config_path)
            text = config_path.read_text()
        elif not self.auto_complete:
            raise KilnError(
                f"failed to load '{name}': {config_path} does not exist, and auto-complete "
                "is disabled (--disable-auto-complete-config): the model needs a complete "
                "config.pbtxt",
                Status.INVALID_ARG,
            )
        else:
            config = ModelConfig()
        if not config.name:
            config.name = name
        # an override's problems are the override's, not the folder's config.pbtxt
        source = JSON_OVERRIDE_PATH if config_json is not None else str(config_path)
        problems = validate_config(config, name, source, text=text)
        if problems:
            raise problems[0]
        versions = version_dirs(model_dir)
        bname = backend_name(config, model_dir)
        cls = backend_class(bname)
        if not config.backend:
            config.backend = bname
        if not config.platform:
            config.platform = platform_for(bname)
        if not config.default_model_filename and cls.default_model_filename:
            config.default_model_filename = cls.default_model_filename
        if not versions:
            raise KilnError(f"failed to load '{name}', no version is available", Status.INVALID_ARG)
        chosen = select_versions(config, list(versions))
        if self.config_check is not None:
            self.config_check(config, chosen)
        check_config_paths(config, name)  # before auto-complete reads any named file
        if self.auto_complete:
            cls.auto_complete_config(config, versions[chosen[-1]])
        elif not len(config.output) and not is_ensemble(config):
            raise KilnError(
                f"failed to load '{name}': {source} declares no output, and auto-complete "
                "is disabled (--disable-auto-complete-config), so none is read from the model",
                Status.INVALID_ARG,
            )
        _complete_scheduling(config, default_batcher=self.auto_complete)
        check_config_paths(config, name)
        problems = validate_config(config, name, source, text=None)
        if problems:
            raise problems[0]
        if is_ensemble(config):
            await self._load_composing(name, config)
        await self._start(entry, config, {v: versions[v] for v in chosen}, cls, files_dir)

    async def _load_served(self, entry: ModelEntry[R], served: ModelConfig) -> None:
        """A ``--model`` checkpoint: version 1, its folder (a ``.gguf`` file's folder) as
        the version folder; the backend reads the checkpoint from ``model_path``."""
        config = ModelConfig()
        config.CopyFrom(served)
        path = Path(config.parameters["model_path"].string_value)
        problems = validate_config(config, entry.name, f"--model {path}", text=None)
        if problems:
            raise problems[0]
        cls = backend_class(config.backend)
        config.platform = platform_for(config.backend)
        version_dir = path.parent if path.is_file() else path
        # no config file declares its tensors: the backend's are the only ones (Triton's
        # vLLM-backend text_input/text_output), whatever --disable-auto-complete-config says
        cls.auto_complete_config(config, version_dir)
        _complete_scheduling(config, default_batcher=self.auto_complete)
        if self.config_check is not None:
            self.config_check(config, [1])
        await self._start(entry, config, {1: version_dir}, cls, None)

    async def _start(
        self,
        entry: ModelEntry[R],
        config: ModelConfig,
        versions: dict[int, Path],
        cls: type[Backend],
        files_dir: Path | None,
    ) -> None:
        """Bring ``versions`` up, then swap them in for the old ones and drain those."""
        name, chosen = entry.name, sorted(versions)
        entry.state = ModelState.LOADING
        new = {v: self.runtime_factory(name, v, config, versions[v], cls, self.get) for v in chosen}
        results = await asyncio.gather(*(r.load() for r in new.values()), return_exceptions=True)
        errors = [(v, e) for v, e in zip(new, results, strict=True) if isinstance(e, BaseException)]
        if errors:
            for runtime in new.values():
                if runtime.ready:
                    await runtime.unload(0)
            version, err = errors[0]
            msg = err.message if isinstance(err, KilnError) else f"{type(err).__name__}: {err}"
            raise KilnError(f"failed to load '{name}' version {version}: {msg}", Status.INVALID_ARG)
        old, old_files = entry.versions, entry.files_dir
        entry.versions, entry.config, entry.files_dir = new, config, files_dir
        entry.state, entry.reason = ModelState.READY, ""
        log.info("loaded model '%s' versions %s", name, chosen)
        for runtime in old.values():
            await runtime.unload(self.drain_timeout)
        if old_files is not None:
            shutil.rmtree(old_files, ignore_errors=True)

    async def _load_composing(self, name: str, config: ModelConfig) -> None:
        """Load the ensemble's composing models that are not serving yet (as Triton does)."""
        chain = (*_LOADING_ENSEMBLES.get(), name)
        models = list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step))
        for model in models:
            if model in chain:
                path = " -> ".join((*chain, model))
                raise invalid_arg(f"ensemble '{name}' contains itself through {path}")
        token = _LOADING_ENSEMBLES.set(chain)
        # The composing loads need load slots of their own: holding this one while waiting
        # on them could deadlock when every slot is held by an ensemble.
        self._load_slots.release()
        try:
            await asyncio.gather(*(self._ensure_loaded(m) for m in models))
        finally:
            await self._load_slots.acquire()
            _LOADING_ENSEMBLES.reset(token)

    async def _ensure_loaded(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None and entry.lock.locked():
            async with entry.lock:  # a load in progress: its outcome decides
                pass
        if entry is not None and any(r.ready for r in entry.versions.values()):
            return
        try:
            await self.load(name, dependency=True)
        except KilnError as exc:
            # A missing folder is a mistake in the ensemble's config, not an unknown model.
            status = Status.INVALID_ARG if exc.status is Status.NOT_FOUND else exc.status
            raise KilnError(f"composing model '{name}': {exc.message}", status) from exc

    def _declares_ensemble(self, name: str) -> bool:
        try:
            path = self.model_dir(name) / CONFIG_NAME
            return path.is_file() and is_ensemble(load_config_file(path))
        except (KilnError, ConfigError):
            return False  # its own load reports the problem

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Unload ``name``. ``unload_dependents`` (Triton's parameter): an ensemble's
        composing models go too, each unless it was loaded by its own name or another
        loaded ensemble still uses it, and so on down nested ensembles."""
        check_model_name(name)
        entry = self.entries.get(name)
        if entry is None:
            return
        async with entry.lock:
            # Dependents go only with an ensemble that was serving: one unloaded before
            # left them to their own unloads.
            config = entry.config if entry.versions else None
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason = ModelState.UNAVAILABLE, "unloaded"
            for runtime in old.values():
                await runtime.unload(self.drain_timeout)
            if entry.files_dir is not None:
                shutil.rmtree(entry.files_dir, ignore_errors=True)
                entry.files_dir = None
        log.info("unloaded model '%s'", name)
        if unload_dependents and config is not None and is_ensemble(config):
            for model in dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step):
                dep = self.entries.get(model)
                if dep is None or not dep.dependency or not dep.versions:
                    continue  # asked for by name, or not loaded
                if any(model in self._composing(e) for e in self.entries.values() if e.versions):
                    continue  # another loaded ensemble still needs it
                await self.unload(model, unload_dependents=True)

    @staticmethod
    def _composing(entry: ModelEntry[R]) -> set[str]:
        config = entry.config
        if config is None or not is_ensemble(config):
            return set()
        return {step.model_name for step in config.ensemble_scheduling.step}

    async def load_many(self, names: list[str]) -> dict[str, str]:
        """Load each of ``names``; returns the ones that failed, with their reasons."""
        failed: dict[str, str] = {}

        async def one(n: str) -> None:
            try:
                await self.load(n)
            except KilnError as exc:
                log.error("%s", exc.message)
                failed[n] = exc.message

        # Ensembles last: their composing models are then loaded once, by their own names.
        loop = asyncio.get_running_loop()
        declares = await asyncio.gather(
            *(loop.run_in_executor(None, self._declares_ensemble, n) for n in names)
        )
        ensembles = [n for n, yes in zip(names, declares, strict=True) if yes]
        await asyncio.gather(*(one(n) for n in names if n not in ensembles))
        await asyncio.gather(*(one(n) for n in ensembles))
        return failed

    async def unload_all(self) -> None:
        await asyncio.gather(*(self.unload(n) for n in list(self.entries)))

    # ---- index -----------------------------------------------------------------------
    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        rows: list[dict[str, str]] = []
        for name in sorted(set(self.model_names()) | set(self.entries)):
            entry = self.entries.get(name)
            if entry and entry.versions:
                for v, rt in sorted(entry.versions.items()):
                    rows.append(
                        {
                            "name": name,
                            "version": str(v),
                            "state": rt.state.value,
                            "reason": rt.reason or entry.reason,  # a failed reload keeps serving
                        }
                    )
            elif entry and entry.state is not ModelState.UNKNOWN:
                rows.append(
                    {
                        "name": name,
                        "version": "",
                        "state": entry.state.value,
                        "reason": entry.reason,
                    }
                )
            else:
                rows.append({"name": name, "version": "", "state": "", "reason": ""})
        if ready_only:
            rows = [r for r in rows if r["state"] == ModelState.READY.value]
        return rows

    def all_ready(self) -> bool:
        return all(
            e.versions and all(r.ready for r in e.versions.values())
            for e in self.entries.values()
            if e.state is not ModelState.UNAVAILABLE or e.reason != "unloaded"
        )


def _complete_scheduling(config: ModelConfig, default_batcher: bool = True) -> None:
    """Triton: one CPU/GPU instance when the config names none; with auto-complete
    (``default_batcher``), a batching model with no scheduler gets an empty
    ``dynamic_batching``.

    Not a Python-backend model: Triton's python backend runs one request per ``execute``
    unless the config or the model's ``auto_complete_config`` asks for the dynamic batcher
    (checked against Triton 2.51: ``max_batch_size: 8`` and no scheduler loads without
    one), and models written for it may read only ``requests[0]``."""
    if not len(config.instance_group) and not is_ensemble(config):
        config.instance_group.add(count=1)
    if (
        default_batcher
        and config.max_batch_size > 1
        and config.WhichOneof("scheduling_choice") is None
        and config.platform != "ensemble"
        and config.backend != "python"
    ):
        config.dynamic_batching.SetInParent()


def _hide_folder(exc: BaseException, folder: Path) -> None:
    """Say ``file:<name>`` where a message names a file of a load's private folder."""

    def hide(text: str) -> str:
        return text.replace(f"{folder}/", "file:").replace(str(folder), "file:")

    exc.args = tuple(hide(a) if isinstance(a, str) else a for a in exc.args)
    # KilnError and ConfigError keep their text in attributes, OSError its file names.
    for attr in ("message", "path", "filename", "filename2"):
        value = getattr(exc, attr, None)
        if isinstance(value, str):
            setattr(exc, attr, hide(value))
