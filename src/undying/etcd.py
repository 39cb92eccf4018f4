"""A small client for etcd's v3 API over its JSON gateway (HTTP), standard library only.

Runs in ``undying run`` (controller candidates), agents and workers of a job started
with ``--etcd``; it sits outside ``undying.controller`` so agents and workers load none
of the controller. It covers what leader election and the controller's saved state
need: get, put, delete, a compare-and-put transaction, and leases (grant, keep-alive,
revoke), over HTTP or HTTPS (a CA, and a client certificate where etcd asks for one: ``tls.py``). Keys and values are text; the gateway wants them base64-encoded and returns
64-bit numbers as strings, both handled here. Any transport failure or non-200 answer
is an ``EtcdUnavailable`` naming the endpoint.
"""

from __future__ import annotations

import base64
import http.client
import json
from dataclasses import dataclass
from typing import Any

from undying.tls import ClientTls


class EtcdUnavailable(ConnectionError):
    """etcd did not answer, or answered with an error."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


@dataclass
class KeyValue:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` (the members of an etcd cluster) -> [(host, port)]."""
    parsed = []
    for endpoint in endpoints.split(","):
        host, sep, port = endpoint.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must be HOST:PORT (got {endpoint!r})")
        parsed.append((host.strip("[]"), int(port)))
    return parsed


class EtcdClient:
    """Talks to an etcd cluster through one of its members' ``host:port`` (comma-separated: the
    next one is tried when the current one fails). Not thread-safe: give each thread its own.
    With ``tls``, HTTPS: each member's certificate verified against its CA (and the member's
    address), this client's own certificate presented where etcd asks for one."""

    def __init__(self, endpoint: str, timeout: float = 2.0, tls: ClientTls | None = None) -> None:
        self.members = parse_endpoints(endpoint)
        self.endpoint = endpoint
        self._member = 0
        self.host, self.port = self.members[0]
        self.timeout = timeout
        self.tls = tls
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        # A kept-alive connection the server closed fails once; a second failure moves on to the
        # cluster's next member; one round over every member, then it is down.
        attempts = 2 * len(self.members)
        for attempt in range(attempts):
            if self._conn is None:
                self._conn = (http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                              if self.tls is None else
                              http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                                          context=self.tls.context()))
            try:
                self._conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                response = self._conn.getresponse()
                payload = response.read()
                break
            except (OSError, http.client.HTTPException) as error:
                self.close()
                if attempt == attempts - 1:
                    raise EtcdUnavailable(f"etcd {self.endpoint}: {error}") from error
                if attempt % 2 == 1:
                    self._member = (self._member + 1) % len(self.members)
                    self.host, self.port = self.members[self._member]
        if response.status != 200:
            raise EtcdUnavailable(f"etcd {self.endpoint}{path}: HTTP {response.status}: {payload[:200]!r}")
        return json.loads(payload)

    # ------------------------------------------------------------------ keys

    def get(self, key: str) -> KeyValue | None:
        reply = self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = reply.get("kvs") or []
        return _key_value(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key that starts with ``prefix``, in key order."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        reply = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return [_key_value(raw) for raw in reply.get("kvs") or []]

    def put(self, key: str, value: str, lease: int = 0) -> int:
        """Store ``value``; returns the revision of the write."""
        return int(self._call("/v3/kv/put", _put_request(key, value, lease))["header"]["revision"])

    def delete(self, key: str) -> None:
        self._call("/v3/kv/deleterange", {"key": _b64(key)})

    def put_if_absent(self, key: str, value: str, lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Create ``key`` only if it does not exist. Returns (created, the key's current holder if not)."""
        reply = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": _put_request(key, value, lease)}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })
        if reply.get("succeeded"):
            return True, None
        ranges = [r["response_range"] for r in reply.get("responses", []) if "response_range" in r]
        kvs = ranges[0].get("kvs") if ranges else None
        return False, _key_value(kvs[0]) if kvs else None

    def put_if_equal(self, guard_key: str, guard_value: str, key: str, value: str, lease: int = 0) -> bool:
        """Write ``key`` only while ``guard_key`` holds ``guard_value`` (a fenced write)."""
        reply = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(guard_key), "target": "VALUE", "result": "EQUAL", "value": _b64(guard_value)}],
            "success": [{"request_put": _put_request(key, value, lease)}],
        })
        return bool(reply.get("succeeded"))

    # ------------------------------------------------------------------ leases

    def grant(self, ttl: int) -> int:
        return int(self._call("/v3/lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its remaining TTL (0 or less: it has expired)."""
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = reply.get("result", reply)
        return int(result.get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})


def _put_request(key: str, value: str, lease: int) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return request


def _key_value(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(raw["key"]), value=_unb64(raw.get("value", "")),
                    create_revision=int(raw.get("create_revision", 0)),
                    mod_revision=int(raw.get("mod_revision", 0)), lease=int(raw.get("lease", 0)))
