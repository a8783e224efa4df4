"""Assembles one PD instance: its KV connector, its control channel and its role, handed to
the engine core it serves. The engine core process calls this; the core itself knows only
the role's interface (``tandem.core.engine_core.DisaggRole``)."""

from __future__ import annotations

import logging

from tandem.disagg.control import ControlChannel
from tandem.disagg.decode_role import DecodeRole
from tandem.disagg.kv_connector import KVConnector, LocalKVConnector
from tandem.disagg.prefill_role import PrefillRole
from tandem.disagg.trust import derive_key, require_secret
from tandem.messages import TO_DECODE, TO_PREFILL

logger = logging.getLogger("tandem.disagg")

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def make_kv_connector(kind: str, **options) -> KVConnector:
    """A connector of ``kind``: "zmq" (signed messages over ZeroMQ; options of ZmqKVConnector),
    "mooncake" (options of MooncakeKVConnector), "nccl" (point-to-point
    send/recv between processes, NCCL on GPUs of one host or several, gloo on the CPU; options of
    NcclKVConnector), "cuda_ipc" (between processes on one GPU host; no options) or "local"
    (options ``registry`` and ``name``)."""
    if kind == "local":
        return LocalKVConnector(**options)
    if kind == "zmq":
        from tandem.disagg.zmq_connector import ZmqKVConnector

        return ZmqKVConnector(**options)
    if kind == "mooncake":
        from tandem.disagg.mooncake_connector import MooncakeKVConnector

        return MooncakeKVConnector(**options)
    if kind == "cuda_ipc":
        from tandem.disagg.cuda_ipc_connector import CudaIpcKVConnector

        return CudaIpcKVConnector(**options)
    if kind == "nccl":
        from tandem.disagg.nccl_connector import NcclKVConnector

        return NcclKVConnector(**options)
    raise ValueError(
        f"kind: unknown KV connector {kind!r} (expected 'zmq', 'mooncake', 'nccl', 'cuda_ipc' "
        "or 'local')"
    )


def warn_if_listening_everywhere(kind: str, host: str) -> bool:
    """Log (and return True) that ``kind``'s ports listen on every interface although
    ``host`` names one: Mooncake's, which no option of 0.3.13 binds to an address."""
    if kind != "mooncake" or host in WILDCARD_HOSTS:
        return False
    logger.warning(
        "KV connector mooncake: its handshake and TCP data ports listen on every interface, "
        "not only on --disagg-host %s, and any peer that reaches them can write into the "
        "registered KV cache; firewall them, or use --kv-connector zmq (binds only %s, "
        "frames signed with the shared secret). See docs/architecture.md, PD trust.",
        host,
        host,
    )
    return True


def _configured_connector(config, secret: str) -> KVConnector:
    """The connector that ``config.disagg`` names, with its options."""
    disagg = config.disagg
    options = {}
    # A write that stalls fails within half the decode side's timeout.
    timeout_s = max(disagg.transfer_timeout_s / 2, 1.0)
    # Only a decode instance receives (binds): a prefill instance's connector listens nowhere.
    receives = {
        "host": disagg.control_host,
        "timeout_s": timeout_s,
        "serve": disagg.role == "decode",
    }
    if disagg.kv_connector == "zmq":
        options = {**receives, "key": derive_key(secret, "kv")}
    elif disagg.kv_connector == "mooncake":
        warn_if_listening_everywhere("mooncake", disagg.control_host)
        options = {"hostname": disagg.control_host, "timeout_s": timeout_s}
    elif disagg.kv_connector == "nccl":
        options = receives
    return make_kv_connector(disagg.kv_connector, **options)


def start_pd_role(core, connector: KVConnector | None = None) -> PrefillRole | DecodeRole:
    """Give ``core`` (an EngineCore whose config's role is prefill or decode) its PD role:
    ``connector`` (tests pass an in-process one) or the configured one registers the core's
    KV caches (target and MTP layers), and a control channel opens, signed with a key derived
    from the config's secret (TrustError without one). Returns the role."""
    disagg = core.config.disagg
    if disagg.role not in ("prefill", "decode"):
        raise ValueError(f"role {disagg.role!r} has no PD side; expected 'prefill' or 'decode'")
    secret = require_secret(disagg.secret, f"a {disagg.role} instance")  # before any listener
    if connector is None:
        connector = _configured_connector(core.config, secret)
    connector.register(core.runner.kv_caches_with_mtp())
    key = derive_key(secret, "control")
    accepts = TO_PREFILL if disagg.role == "prefill" else TO_DECODE
    channel = ControlChannel(disagg.control_host, disagg.control_port, accepts, key)
    logger.info(
        "%s instance: control channel %s, KV connector %s",
        disagg.role,
        channel.address,
        type(connector).__name__,
    )
    if disagg.role == "prefill":
        role = PrefillRole(core, channel, connector)
    else:
        role = DecodeRole(core, channel, connector, disagg.transfer_timeout_s)
    core.attach_pd_role(role)
    return role
