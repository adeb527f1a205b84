"""API keys and tenants: who may call the server, and whose n-gram scope a request reads and writes.

With keys (`--api-key`, `--api-key-file`), every /v1 request needs `Authorization: Bearer <key>`
with one of them, else 401. The tenant is then the key (kept as its SHA-256), and a request's
`user` only sub-scopes within its key: two keys never share a scope, whatever `user` they send.
Without keys anyone may call, and the tenant is what the client says: the bearer token as sent,
else `user`, else the anonymous tenant. Those scopes are advisory: a client that sends another's
token or `user` reads that tenant's scope.

A tenant's metrics label is "key-" or "user-" and the first 12 hex digits of the SHA-256 of the
key or `user` (`printf %s "$KEY" | sha256sum | cut -c1-12`), or "anonymous"; never the key itself.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os

from specjax.serving.server.protocol import APIError


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_key_file(path: str | os.PathLike) -> list[str]:
    """The keys in a file, one a line; blank lines and lines starting with # are skipped."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


@dataclasses.dataclass(frozen=True)
class Tenant:
    """Whose request this is: `scope` names its n-gram table scope (None: the anonymous tenant),
    `label` its series in /metrics."""

    scope: str | None
    label: str


ANONYMOUS = Tenant(None, "anonymous")


class Keys:
    """The API keys a server accepts (none: every request is let in), kept as SHA-256 hashes."""

    def __init__(self, keys=()):
        keys = list(keys)
        bad = [i for i, k in enumerate(keys) if not k or k != k.strip() or any(c.isspace() for c in k)]
        if bad:
            raise ValueError(f"API key #{bad[0] + 1}: a key is a non-empty string without whitespace")
        self._hashes = frozenset(_sha256(k) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._hashes)

    def tenant(self, authorization: str | None, user: str | None) -> Tenant:
        """The tenant of a request with this `Authorization` header and `user` field. With keys,
        raises `APIError(401)` unless the header carries one of them."""
        token = _bearer(authorization)
        if self._hashes:
            h = None if token is None else _sha256(token)
            if h not in self._hashes:
                raise APIError(401, "missing or unknown API key: send the header 'Authorization: Bearer <key>' "
                                    "with a key this server was started with (--api-key)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return Tenant(f"key:{h}" + (f"\0user:{user}" if user else ""), f"key-{h[:12]}")
        if token is not None:
            return Tenant(f"key:{token}", f"key-{_sha256(token)[:12]}")
        if user:
            return Tenant(f"user:{user}", f"user-{_sha256(user)[:12]}")
        return ANONYMOUS


def _bearer(authorization: str | None) -> str | None:
    if not authorization or not authorization[:7].lower() == "bearer ":
        return None
    return authorization[7:].strip() or None


class TenantIds:
    """The n-gram table's scope id of each tenant, given on first sight; 0 is the anonymous tenant.

    The last `limit` tenants are remembered (a client sending a new `user` each time cannot grow it
    without bound); one forgotten and seen again gets a new id, so its old table entries are never
    proposed again, to it or anyone. Ids are never reused. Scopes are kept hashed.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._ids: collections.OrderedDict[str, int] = collections.OrderedDict()  # hashed scope -> id, LRU
        self._next = 1

    def __len__(self) -> int:
        return len(self._ids)

    def id(self, scope: str | None) -> int:
        if scope is None:
            return 0
        h = _sha256(scope)
        if h in self._ids:
            self._ids.move_to_end(h)
            return self._ids[h]
        if self._next >= 2 ** 31:
            raise APIError(503, "too many tenants for the n-gram table's scopes; restart the server",
                           type="server_error")
        self._ids[h] = self._next
        self._next += 1
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)
        return self._ids[h]
