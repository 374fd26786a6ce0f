"""API keys: each maps to a tenant, the knowledge bases and groups it may use, and whether it may edit.

    [[keys]]
    key = "sk-support-1"
    tenant = "acme"
    admin = false                 # may add, update and delete knowledge-base documents
    [keys.kb]
    albaran = ["support"]         # knowledge base -> its groups this key reads as (first is the default)

    [tenants.acme]
    cache = "tenant"              # opt in: all of acme's keys share what their requests bring

What a request brings (documents, chat turns, a plain prompt) is cached per tenant and group by default:
with a kb, the group it reads as; without one, the key's groups (`Principal.scope`), so keys of the same
groups share and no other group of the tenant can tell what they sent. A tenant whose `cache` is
"tenant" shares one cache across its groups. Shared kb documents stay shared as before.
"""

from __future__ import annotations

import hmac
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvfuse.request import Salt

CACHE_SCOPES = ("group", "tenant")  # [tenants.NAME] cache = ...; "group" is the default


class KeysError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str | None
    kb_groups: dict[str, tuple[str, ...]] | None = field(default=None)  # None: every kb and group (no auth)
    admin: bool = True
    tenant_wide: bool = False  # keys.toml's [tenants.NAME] cache = "tenant"

    def scope(self) -> str:
        """The key's groups, one canonical string: 'albaran=leads,support;other=x' ('' for none)."""
        return ";".join(f"{kb}={','.join(sorted(g))}" for kb, g in sorted((self.kb_groups or {}).items()))

    def salt(self, kb: str | None = None, group: str | None = None) -> Salt | None:
        """The salt of what this caller's request brings: its tenant and the group it reads kb as, or
        without a kb the key's groups (`scope`); its tenant alone where the tenant opted in."""
        return Salt.of_owner(self.tenant, group if kb is not None else self.scope(), kb, self.tenant_wide)

    def groups_for(self, kb: str) -> tuple[str, ...] | None:
        """The groups this caller reads kb as; None means any group (no auth); () means no access."""
        if self.kb_groups is None:
            return None
        return self.kb_groups.get(kb, ())


ANONYMOUS = Principal(tenant=None)


class Keys:
    def __init__(self, principals: dict[str, Principal]) -> None:
        self._by_key = principals

    @classmethod
    def load(cls, path: str | Path) -> Keys:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise KeysError(f"cannot read --keys {p}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise KeysError(f"--keys {p} is not valid TOML: {e}") from None
        wide = _tenant_wide(raw.get("tenants", {}), p)
        out: dict[str, Principal] = {}
        for i, k in enumerate(raw.get("keys", [])):
            if not isinstance(k, dict) or not isinstance(k.get("key"), str) or len(k["key"]) < 8:
                raise KeysError(f"--keys {p}: keys[{i}] needs a key string of at least 8 characters")
            if not isinstance(k.get("tenant"), str) or not k["tenant"]:
                raise KeysError(f"--keys {p}: keys[{i}] needs a tenant")
            kbs = k.get("kb", {})
            if not isinstance(kbs, dict) or not all(isinstance(v, list) and v for v in kbs.values()):
                raise KeysError(f"--keys {p}: keys[{i}].kb maps knowledge bases to non-empty lists of groups")
            if k["key"] in out:
                raise KeysError(f"--keys {p}: a key is listed twice")
            out[k["key"]] = Principal(k["tenant"], {n: tuple(map(str, g)) for n, g in kbs.items()},
                                      bool(k.get("admin", False)), k["tenant"] in wide)
        if not out:
            raise KeysError(f"--keys {p} lists no [[keys]]")
        return cls(out)

    def lookup(self, header: str | None) -> Principal | None:
        scheme, _, given = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 7235)
            return None
        given = given.strip()
        for key, principal in self._by_key.items():
            if hmac.compare_digest(key.encode(), given.encode()):
                return principal
        return None


def _tenant_wide(tenants: object, p: Path) -> set[str]:
    """The tenants whose `[tenants.NAME] cache` is "tenant" (checked: a typo must not widen or narrow it)."""
    if not isinstance(tenants, dict):
        raise KeysError(f"--keys {p}: [tenants] maps tenant names to tables such as [tenants.acme]")
    out = set()
    for name, t in tenants.items():
        if not isinstance(t, dict) or set(t) - {"cache"} or t.get("cache", "group") not in CACHE_SCOPES:
            raise KeysError(f"--keys {p}: [tenants.{name}] takes only cache = \"group\" (the default) or "
                            "\"tenant\" (every group of the tenant shares one cache)")
        if t.get("cache") == "tenant":
            out.add(name)
    return out
