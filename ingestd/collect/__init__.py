"""Collecting experience: the env/policy contracts and how they are named.

Built-in envs live in ``ingestd.collect.envs``, built-in policies in
``ingestd.collect.policies``; both are imported only when named.
"""
from ingestd.collect.interfaces import Env, EnvContext, EnvSpec, Policy
from ingestd.collect.registry import (
    ENV_ALIASES, POLICY_ALIASES, make_env, make_policy, resolve, resolve_env, resolve_policy, validate_kwargs,
)

__all__ = [
    "Env", "EnvContext", "EnvSpec", "Policy",
    "ENV_ALIASES", "POLICY_ALIASES", "make_env", "make_policy", "resolve", "resolve_env", "resolve_policy",
    "validate_kwargs",
]
