"""API keys: one shared key, or a file of keys that each name a tenant.

Keys are compared in constant time (``hmac.compare_digest`` against every key, no early
exit). Each tenant gets its own prefix-cache salt, so two tenants never share KV blocks
and cannot time each other's prompts; a client's own ``cache_salt`` is added to it.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Optional

from vpage.entrypoints.openai.protocol import ApiError


class ApiKeys:
    """``keys`` maps each accepted key to its tenant (None: the single-key, no-tenant case).
    With no keys every request is allowed."""

    def __init__(self, keys: dict[str, Optional[str]]):
        self._keys = [(k.encode(), t) for k, t in keys.items()]

    @classmethod
    def from_options(cls, api_key: Optional[str], keys_file: Optional[str]) -> "ApiKeys":
        """``--api-key`` (or VPAGE_API_KEY) and ``--api-keys FILE``: lines ``TENANT KEY``,
        blank lines and ``#`` comments ignored. ValueError for a malformed file."""
        keys: dict[str, Optional[str]] = {}
        if api_key:
            keys[api_key] = None
        if keys_file:
            for number, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise ValueError(f"{keys_file}:{number}: expected 'TENANT KEY'")
                keys[parts[1]] = parts[0]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: Optional[str]) -> Optional[str]:
        """The tenant of ``Authorization: Bearer KEY`` (None for the shared key); ApiError(401)
        when keys are required and this one is missing or wrong."""
        if not self._keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        given_bytes = given.strip().encode("utf-8", "replace")
        found, tenant = False, None
        for key, owner in self._keys:
            if hmac.compare_digest(key, given_bytes) and scheme.lower() == "bearer":
                found, tenant = True, owner
        if not found:
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})
        return tenant


def cache_salt(tenant: Optional[str], client_salt: Optional[str]) -> Optional[str]:
    """The prefix-cache salt of a request: the tenant's, then the client's own."""
    parts = ([f"tenant:{tenant}"] if tenant is not None else []) + ([f"client:{client_salt}"] if client_salt else [])
    return "|".join(parts) or None
