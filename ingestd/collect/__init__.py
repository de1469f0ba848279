"""Collecting experience: the env/policy contracts and how they are named.

Built-in envs live in ``ingestd.collect.envs``, built-in policies in
``ingestd.collect.policies``; both are imported only when named. The names
below are imported on first use: torch-free modules of this package
(``inherited``) serve ``ingestd run`` before torch's import.
"""
from ingestd.lazy import lazy_attributes

_SOURCES = {
    **dict.fromkeys(("Env", "EnvContext", "EnvSpec", "Policy"), "ingestd.collect.interfaces"),
    **dict.fromkeys(("ENV_ALIASES", "POLICY_ALIASES", "make_env", "make_policy", "resolve", "resolve_env",
                     "resolve_policy", "validate_kwargs"), "ingestd.collect.registry"),
}
__all__ = list(_SOURCES)
__getattr__ = lazy_attributes(__name__, _SOURCES)
