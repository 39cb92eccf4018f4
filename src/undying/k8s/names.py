"""Kubernetes names, label keys and values, and resource quantities, checked as the API server
checks them, so that a bad ``undying k8s render`` option is one line at render time rather than a
rejected ``kubectl apply``.

Runs in the ``undying k8s render`` process. Each check raises ``RenderError`` naming the option.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation


class RenderError(ValueError):
    """A render option that cannot make a valid job; ``str()`` is one line naming the option."""


def option_error(option: str, allowed: str, got: object, problem: str = "") -> RenderError:
    """``OPTION: [PROBLEM; ]allowed ALLOWED (got VALUE)``, the shape of every render error."""
    lead = f"{problem}; " if problem else ""
    return RenderError(" ".join(f"{option}: {lead}allowed {allowed} (got {got!r})".splitlines()))


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(_DNS_LABEL)
DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# Kubernetes' own quantity grammar (apimachinery's resource.Quantity): a number and a suffix.
_QUANTITY = re.compile(r"(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?[0-9]+)?")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal("1e3"),
            "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18")}


def check_dns_label(option: str, name: str, longest: int = 63) -> str:
    """An object name that also becomes a DNS label (a Service, a job whose pods' names derive from it)."""
    if len(name) > longest or not DNS_LABEL.fullmatch(name):
        raise option_error(option, f"1-{longest} lowercase letters, digits or '-', starting and ending with a "
                                   "letter or digit", name)
    return name


def check_object_name(option: str, name: str) -> str:
    """The name of a Secret, PersistentVolumeClaim, ServiceAccount, PriorityClass (a DNS subdomain)."""
    if len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name):
        raise option_error(option, "a Kubernetes object name: lowercase letters, digits, '-' and '.', starting and "
                                   "ending with a letter or digit, at most 253 characters", name)
    return name


def check_qualified_name(option: str, key: str) -> str:
    """A label or annotation key, or a resource name: ``[PREFIX/]NAME`` (PREFIX a DNS subdomain)."""
    prefix, slash, name = key.rpartition("/")
    good_prefix = not slash or (len(prefix) <= 253 and DNS_SUBDOMAIN.fullmatch(prefix) is not None)
    if not good_prefix or len(name) > 63 or not _NAME_PART.fullmatch(name):
        raise option_error(option, "a key [PREFIX/]NAME: NAME 1-63 letters, digits, '-', '_' or '.' starting and "
                                   "ending with a letter or digit; PREFIX a DNS subdomain", key)
    return key


def check_label_value(option: str, value: str) -> str:
    if len(value) > 63 or not LABEL_VALUE.fullmatch(value):
        raise option_error(option, "a label value: at most 63 letters, digits, '-', '_' or '.', starting and "
                                   "ending with a letter or digit", value)
    return value


def check_extended_resource(option: str, name: str) -> str:
    """A device plugin's resource (``nvidia.com/gpu``): a qualified name with a domain outside kubernetes.io."""
    prefix, slash, _ = name.rpartition("/")
    try:
        check_qualified_name(option, name)
    except RenderError:
        slash = ""
    if not slash or prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        raise option_error(option, "an extended resource DOMAIN/NAME, e.g. nvidia.com/gpu, amd.com/gpu", name)
    return name


def check_key_value(option: str, text: str) -> tuple[str, str]:
    """``KEY=VALUE`` with a qualified key (the value is checked by the caller: labels and annotations differ)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise option_error(option, "KEY=VALUE", text)
    return check_qualified_name(option, key), value


def quantity_value(option: str, text: str) -> Decimal:
    """A resource quantity (``500m``, ``64Gi``, ``1.5``) as a number of base units (cores, bytes)."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise option_error(option, "a Kubernetes quantity, e.g. 16, 500m, 64Gi, 1.5T", text)
    suffix = match["suffix"] or ""
    try:
        number = Decimal(match["number"])
    except InvalidOperation:
        raise option_error(option, "a Kubernetes quantity, e.g. 16, 500m, 64Gi, 1.5T", text) from None
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** int(suffix[1:])
    return number * _DECIMAL[suffix]

