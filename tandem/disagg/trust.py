"""Trust between PD instances and their router: one shared secret, never sent itself.

Every prefill instance, decode instance and router of one deployment is given the same
secret (``--disagg-secret`` or the environment variable ``TANDEM_DISAGG_SECRET``). Keys for
each use are derived from it, so a key that leaks from one use does not serve another:

- the router signs the prefill URL it names (``x-tandem-prefill-signature``); a decode
  instance calls a prefill URL only with a valid signature, so a client cannot make it
  call an address of the client's choosing;
- every control-channel frame carries an HMAC-SHA256 over its time, a nonce and its body
  (``tandem.disagg.control``).

Import-light (no torch, no ZeroMQ): the router uses it.
"""

from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "TANDEM_DISAGG_SECRET"
PREFILL_SIGNATURE_HEADER = "x-tandem-prefill-signature"
MIN_SECRET_CHARS = 16


class TrustError(ValueError):
    """A missing or unusable shared secret."""


def resolve_secret(value: str | None) -> str | None:
    """The secret given on the command line, else the environment's, else None; TrustError
    if it is shorter than ``MIN_SECRET_CHARS`` (a guessable key is no key)."""
    secret = value if value else os.environ.get(SECRET_ENV) or None
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise TrustError(
            f"disagg_secret: expected at least {MIN_SECRET_CHARS} characters, got {len(secret)}"
        )
    return secret


def require_secret(secret: str | None, who: str) -> str:
    """``secret``, or TrustError saying that ``who`` needs one."""
    if not secret:
        raise TrustError(
            f"{who} needs the deployment's shared secret: --disagg-secret or the environment "
            f"variable {SECRET_ENV} (the same value on every prefill and decode instance and "
            "the router)"
        )
    return secret


def derive_key(secret: str, purpose: str) -> bytes:
    """The 32-byte key for ``purpose`` (one secret, one key per use)."""
    return hmac.new(secret.encode(), f"tandem:{purpose}".encode(), hashlib.sha256).digest()


def sign_prefill_url(secret: str, url: str) -> str:
    """The router's signature of the prefill URL it names (hex HMAC-SHA256). It authorizes
    that URL only: a captured signature can name nothing but the prefill the router chose."""
    key = derive_key(secret, "prefill-url")
    return hmac.new(key, url.encode(), hashlib.sha256).hexdigest()


def prefill_url_signed(secret: str | None, url: str, signature: str | None) -> bool:
    """Whether ``signature`` is the router's signature of ``url`` (constant-time compare);
    False without a secret or a signature."""
    if not secret or not signature:
        return False
    expected = sign_prefill_url(secret, url)
    return hmac.compare_digest(expected.encode(), signature.encode(errors="replace"))
