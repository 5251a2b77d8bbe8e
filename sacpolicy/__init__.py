"""sacpolicy: speculative decoding plus adaptive computation."""

import sys

__version__ = "0.1.0"

# Modules that moved into packages (issue 35). Importing an old path fails at once with the new one in the message,
# rather than with a bare "No module named ..." or, worse, a stale copy left in an old install.
MOVED_MODULES: dict[str, str] = {
    "sacpolicy.gguf": "sacpolicy.models.gguf",
    "sacpolicy.sources": "sacpolicy.data.sources",
    "sacpolicy.data_hf": "sacpolicy.data.hf",
    "sacpolicy.splits": "sacpolicy.data.splits",
    "sacpolicy.assets": "sacpolicy.data.assets",
    "sacpolicy.sharegpt": "sacpolicy.data.sharegpt",
    "sacpolicy.cost_fit": "sacpolicy.profiling.fit",
    "sacpolicy.tracking": "sacpolicy.pipeline.tracking",
    "sacpolicy.policy.rules": "sacpolicy.policy.baselines",  # hand-made rules (runtime.rule is the learned one's)
}


class _MovedModuleFinder:
    """A meta path finder that answers only the old paths in ``MOVED_MODULES``, with a ModuleNotFoundError naming the
    new path; every other import passes on to the next finder."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        # no name=: ``from sacpolicy import gguf`` would then swallow this message into "cannot import name"
        raise ModuleNotFoundError(f"{fullname} moved to {new}; import it from there")


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())
