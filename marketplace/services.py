"""Writes for the marketplace. Each function is one transaction; callers pass keywords."""

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from accounts.models import User
from accounts.secrets import secret_check, secret_issue, secret_matches, secret_prefix
from billing import pricing
from billing import services as billing
from billing.selectors import wallet_balance
from config.prepared import Prepared
from config.redis import REDIS_ERRORS
from marketplace import (
    alerts,
    costs,
    engine_address,
    engine_config,
    engine_keys,
    engine_tls,
    heartbeat_fast,
    uptime,
)
from marketplace.models import (
    Card,
    EngineOverride,
    EnrolmentToken,
    Listing,
    Node,
    NodeStatusChange,
    NodeUptimeHour,
    Rental,
    UuidConflict,
    card_ref,
)

log = logging.getLogger(__name__)

# Facts a heartbeat carries per GPU, stored on Card under the same names.
CARD_FACTS = ("uuid", "name", "memory_total_mib", "compute_capability", "pcie_gen_current",
              "pcie_gen_max", "pcie_width_current", "pcie_width_max", "power_limit_w",
              "nvlink_links")
# Facts whose change means the hardware is not what was verified (PCIe current width and
# generation move with load, so they do not count).
_IDENTITY_FACTS = ("uuid", "name", "memory_total_mib", "compute_capability", "pcie_gen_max",
                   "pcie_width_max", "power_limit_w")
# Identity facts too, but only a change between two known values counts: an agent that starts
# to report one (an upgrade) is the same machine, not one to verify again.
_IDENTITY_FACTS_ONCE_KNOWN = ("nvlink_links",)


class MarketplaceError(Exception):
    """A refusal with a sentence the user can read."""


class EnrolmentRefused(MarketplaceError):
    pass


class CredentialRefused(MarketplaceError):
    def __init__(self, message: str, *, revoked: bool = False):
        super().__init__(message)
        self.revoked = revoked


class RentalRefused(MarketplaceError):
    pass


# --- locks: taken only here, always card before rental, so two paths never deadlock. Row locks
# on nodes and cards are FOR NO KEY UPDATE (what an UPDATE takes): a row that refers to them
# (a finding, a capacity, an alert) checks its key at commit with FOR KEY SHARE, which a
# FOR UPDATE would block while its holder waits for that row: a deadlock ---

def _lock_card(card_id: int) -> Card:
    return (Card.objects.select_for_update(of=("self",), no_key=True)
            .select_related("node", "listing").get(pk=card_id))


# Read on every heartbeat: compiled once (config/prepared.py).
_NODE_LOCKED = Prepared(lambda pk: Node.objects.select_for_update(no_key=True).filter(pk=pk)
                        .order_by(), int)
_NODE_BY_PREFIX = Prepared(lambda prefix: Node.objects.filter(credential_prefix=prefix)
                           .order_by())
_CARDS_OF_NODE = Prepared(lambda node_id: Card.objects.filter(node_id=node_id).order_by(), int)


def _lock_node(node_id: int) -> Node:
    (node,) = _NODE_LOCKED(node_id) or _missing(Node)
    return node


def _missing(model):
    raise model.DoesNotExist(f"{model._meta.object_name} matching query does not exist.")


# --- enrolment ---

def enrolment_token_create(*, owner: User, now: datetime | None = None
                           ) -> tuple[EnrolmentToken, str]:
    now = now or timezone.now()
    issued = secret_issue("rse")
    row = EnrolmentToken.objects.create(
        owner=owner, prefix=issued.prefix, digest=issued.digest, created_at=now,
        expires_at=now + timedelta(hours=settings.RIGSHARE_ENROLMENT_TOKEN_TTL_H))
    return row, issued.token


def enrolment_token_revoke(*, owner: User, token_id: int) -> bool:
    return bool(EnrolmentToken.objects.filter(
        pk=token_id, owner=owner, used_at__isnull=True, revoked_at__isnull=True,
    ).update(revoked_at=timezone.now()))


@dataclass(frozen=True)
class Enrolment:
    node: Node
    credential: str  # shown to the agent once
    engine_key: str  # the engine's --api-key, handed to the agent (engine_keys.py)


@transaction.atomic
def node_enroll(*, token: str, hostname: str, agent_version: str,
                now: datetime | None = None) -> Enrolment:
    """Spend an enrolment token and create the node it was issued for."""
    now = now or timezone.now()
    prefix = secret_prefix(token, "rse")
    row = EnrolmentToken.objects.filter(prefix=prefix).first() if prefix else None
    if row is None or not secret_matches(token, row.digest):
        raise EnrolmentRefused("This enrolment token is not valid.")
    state = row.state(now)
    if state != "active":
        raise EnrolmentRefused({
            "used": "This enrolment token has already been used.",
            "revoked": "This enrolment token has been revoked.",
            "expired": "This enrolment token has expired.",
        }[state])
    # Spend it with a compare-and-set: of two agents racing with one token, one gets a node.
    spent = EnrolmentToken.objects.filter(
        pk=row.pk, used_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now,
    ).update(used_at=now)
    if spent != 1:
        raise EnrolmentRefused("This enrolment token has already been used.")
    credential = secret_issue("rsn")
    engine_key = engine_keys.issue()
    node = Node.objects.create(
        owner=row.owner, name=(hostname or "machine")[:100], hostname=hostname[:256],
        agent_version=agent_version[:64], created_at=now, status_changed_at=now,
        credential_prefix=credential.prefix, credential_digest=credential.digest,
        engine_key_next=engine_keys.seal(engine_key))
    EnrolmentToken.objects.filter(pk=row.pk).update(node=node)
    return Enrolment(node=node, credential=credential.token, engine_key=engine_key)


def node_authenticate(*, credential: str) -> Node:
    prefix = secret_prefix(credential, "rsn")
    node = next(iter(_NODE_BY_PREFIX(prefix)), None) if prefix else None
    kept = secret_check(credential, node.credential_digest) if node is not None else None
    if kept is None:
        raise CredentialRefused("Unknown node credential.")
    if node.credential_revoked_at:
        raise CredentialRefused("This node's credential has been revoked.", revoked=True)
    if kept != node.credential_digest:  # made under a SECRET_KEY since replaced
        Node.objects.filter(pk=node.pk).update(credential_digest=kept)
        node.credential_digest = kept
    return node


def node_revoke(*, owner: User, node_id: int) -> bool:
    """The provider removes a machine: its agent is refused from now on, its cards unlisted."""
    with transaction.atomic():
        revoked = Node.objects.filter(
            pk=node_id, owner=owner, credential_revoked_at__isnull=True,
        ).update(credential_revoked_at=timezone.now(), status=Node.Status.OFFLINE,
                 status_changed_at=timezone.now())
        if revoked:
            Listing.objects.filter(card__node_id=node_id).update(is_listed=False)
            catalog_choices_forget()
            NodeStatusChange.objects.create(node_id=node_id, status=Node.Status.OFFLINE)
            # Its agent is refused from its next heartbeat on, and the nodes it held a GPU UUID
            # against are judged again at theirs.
            node_heartbeat_forget(node_ids=[node_id, *_held_against(node_id)])
    return bool(revoked)


def provider_leave(*, owner: User) -> int:
    """The account closes: each of its machines is removed as by the provider (agent refused,
    cards unlisted) and its unused enrolment tokens stop working. Returns the machines removed."""
    now = timezone.now()
    EnrolmentToken.objects.filter(owner=owner, used_at__isnull=True,
                                  revoked_at__isnull=True).update(revoked_at=now)
    return sum(node_revoke(owner=owner, node_id=node_id) for node_id in
               Node.objects.filter(owner=owner).values_list("pk", flat=True))


def node_update(*, owner: User, node_id: int, name: str, region: str) -> Node:
    node = Node.objects.get(pk=node_id, owner=owner)
    if node.region != region:
        catalog_choices_forget()
    node.name, node.region = name, region
    node.save(update_fields=["name", "region"])
    return node


@transaction.atomic
def engine_override_set(*, node_id: int, flag: str, value: str, reason: str,
                        set_by: User | None, owner: User | None = None,
                        now: datetime | None = None) -> EngineOverride:
    """Set one flag of a node's engine command by hand (replacing an earlier value of that
    flag). `owner` limits it to that provider's node; staff pass None. The value must already
    have been checked against the node (forms.EngineOverrideForm); here it is normalised, and
    a flag nobody may set or a value out of range is refused."""
    node = _lock_node(node_id) if owner is None else \
        Node.objects.select_for_update(no_key=True).get(pk=node_id, owner=owner)
    try:
        value = engine_config.canonical_value(flag, value)
    except engine_config.OverrideError as exc:
        raise MarketplaceError(str(exc)) from None
    row, _ = EngineOverride.objects.update_or_create(
        node=node, flag=flag.strip(),
        defaults={"value": value, "reason": reason.strip(), "set_by": set_by,
                  "set_at": now or timezone.now()})
    # The engine command the node's agent is told (a later heartbeat reply) changes.
    node_heartbeat_forget(node_ids=[node.pk])
    return row


@transaction.atomic
def engine_override_clear(*, node_id: int, flag: str, owner: User | None = None) -> bool:
    """Back to the computed value; False when the flag had no override on that node."""
    nodes = Node.objects.filter(pk=node_id)
    if owner is not None:
        nodes = nodes.filter(owner=owner)
    deleted, _ = EngineOverride.objects.filter(node__in=nodes, flag=flag).delete()
    if deleted:
        node_heartbeat_forget(node_ids=[node_id])
    return bool(deleted)


# The catalog's GPU and region choices, as selectors.catalog_choices caches them.
CATALOG_CHOICES_KEY = "catalog:choices"


def catalog_choices_forget() -> None:
    """What the catalog offers may have changed (a card listed or unlisted, a GPU gone or
    renamed, a region changed): its choices are read again once this transaction commits."""
    def forget():
        try:
            cache.delete(CATALOG_CHOICES_KEY)
        except REDIS_ERRORS:
            log.warning("catalog choices not forgotten: Redis is away; they expire in a minute")
    transaction.on_commit(forget)


# --- heartbeats ---

@dataclass(frozen=True)
class HeartbeatResult:
    node: Node
    hardware_changed: bool
    first_report: bool  # the first heartbeat that brought GPUs: time to verify them
    uuid_conflicts_changed: bool = False  # a UUID conflict of this node opened or closed
    # The engine the agent runs became ready with another command: verified again.
    engine_changed: bool = False


# The engine's address is looked up again at least this often: a provider may move it.
ENGINE_RECHECK = timedelta(minutes=10)


def _engine_connect(node: Node, url: str, now: datetime) -> tuple[str, str] | None:
    """(connect URL, refusal) when the reported URL needs checking, None when the stored check
    stands (`node` as read before its row is locked: a DNS lookup may take a while)."""
    if node.engine_url == url and node.engine_checked_at \
            and now - node.engine_checked_at < ENGINE_RECHECK:
        return None
    if not url:
        return "", ""
    try:
        checked = engine_address.check(url, allowed_networks=settings.RIGSHARE_ENGINE_NETWORKS)
    except engine_address.EngineAddressRefused as exc:
        return "", f"refused: {exc}"
    return checked.connect_url, ""


def node_heartbeat_record(*, node_id: int, report: dict, now: datetime | None = None,
                          node: Node | None = None) -> HeartbeatResult:
    """Store what the agent reports; the only writer of hardware facts. `report` is validated;
    `node`: the node as the heartbeat's authentication read it, if it did (its row is read
    again, locked)."""
    now = now or timezone.now()
    engine = report.get("engine") or {}
    connect = _engine_connect(node or Node.objects.get(pk=node_id), engine.get("url") or "", now)
    return _heartbeat_store(node_id=node_id, report=report, connect=connect, now=now)


# A card's and a deployment's `last_seen_at` is moved this often, not at every heartbeat: it
# is display only (the node's last_heartbeat_at is its liveness), and a write per card per
# beat is most of what a repeated report would cost.
SEEN_EVERY = timedelta(minutes=1)
# What the heartbeat writes of a node; the row's other columns (verdicts, keys, holds) belong
# to other writers and are never written back from this read.
_NODE_REPORTED = (
    "hostname", "os", "agent_version", "driver_version", "cuda_version", "has_nvidia",
    "simulated", "cpu_model", "cpu_cores", "ram_mib", "disk_free_gb", "net_link_mbps",
    "engine_versions", "engine_url", "engine_connect_url", "engine_checked_at",
    "engine_tls_certificate", "engine_tls_fingerprint",
    "engine_reachable", "engine_models", "engine_served", "engine_error", "engine_state",
    "engine_state_since", "engine_process", "engine_ready_digest", "hardware_changed_at",
    "status", "status_changed_at", "last_heartbeat_at")


@transaction.atomic(savepoint=False)  # inside the heartbeat's transaction: no savepoint
def _heartbeat_store(*, node_id: int, report: dict, connect: tuple[str, str] | None,
                     now: datetime) -> HeartbeatResult:
    node = _lock_node(node_id)
    before = {name: getattr(node, name) for name in _NODE_REPORTED}
    engine = report.get("engine") or {}
    gpus = report.get("gpus") or []

    cards = _CARDS_OF_NODE(node.pk)
    existing = {card.index: card for card in cards}
    first_report = not existing and bool(gpus)
    changed = node.driver_version != (report.get("driver_version") or "") and bool(
        node.last_heartbeat_at)
    seen_indexes = set()
    for gpu in gpus:
        facts = {name: gpu.get(name) for name in CARD_FACTS}
        facts["uuid"] = facts["uuid"] or ""
        facts["compute_capability"] = facts["compute_capability"] or ""
        seen_indexes.add(gpu["index"])
        card = existing.get(gpu["index"])
        # Reported while the platform measures the machine (report_power): kept, with its
        # time, for the load test to read; a heartbeat without it leaves the last reading.
        if gpu.get("power_draw_w") is not None:
            facts.update(power_draw_w=gpu["power_draw_w"], power_read_at=now)
        if card is None:
            card = Card.objects.create(node=node, index=gpu["index"], first_seen_at=now,
                                       last_seen_at=now, **facts)
            Listing.objects.create(card=card)
            cards.append(card)
            changed = changed or bool(node.last_heartbeat_at)
            continue
        if any(getattr(card, name) != facts[name] for name in _IDENTITY_FACTS) or not card.present:
            changed = True
        if any(None not in (getattr(card, name), facts[name]) and getattr(card, name) != facts[name]
               for name in _IDENTITY_FACTS_ONCE_KNOWN):
            changed = True
        moved = [name for name, value in facts.items() if getattr(card, name) != value]
        if not moved and card.present and now - card.last_seen_at < SEEN_EVERY:
            continue
        for name in moved:
            setattr(card, name, facts[name])
        card.present, card.last_seen_at = True, now
        # The card's row was read unlocked: write only what the heartbeat owns, never a stale
        # copy of a verdict published meanwhile.
        card.save(update_fields=[*moved, "present", "last_seen_at"])
    gone = [card.pk for index, card in existing.items()
            if index not in seen_indexes and card.present]
    if gone:
        changed = True
        Card.objects.filter(pk__in=gone).update(present=False)
        Listing.objects.filter(card_id__in=gone).update(is_listed=False)
        for card in cards:
            if card.pk in gone:
                card.present = False

    was_online = node.is_online
    node.hostname = report.get("hostname", "")
    node.os = report.get("os", "")
    node.agent_version = report.get("agent_version", "")
    node.driver_version = report.get("driver_version") or ""
    node.cuda_version = report.get("cuda_version") or ""
    node.has_nvidia = bool(report.get("nvidia"))
    node.simulated = bool(report.get("simulated"))
    host = report.get("host") or {}
    node.cpu_model = host.get("cpu_model") or ""
    for name in ("cpu_cores", "ram_mib", "disk_free_gb", "net_link_mbps"):
        setattr(node, name, host.get(name))
    node.engine_versions = report.get("engine_versions") or {}
    node.engine_url = engine.get("url") or ""
    refusal = ""
    if connect is not None:
        node.engine_connect_url, refusal = connect
        node.engine_checked_at = now
    elif not node.engine_connect_url and node.engine_url:
        refusal = (node.engine_error if node.engine_error.startswith("refused:")
                   else "refused: the engine's address is not a public one")
    # The certificate the platform's connections pin (engine_tls.py): only for an engine it
    # calls over TLS.
    certificate = (engine.get("tls_certificate") or ""
                   if node.engine_connect_url.startswith("https://") else "")
    if certificate != node.engine_tls_certificate:
        node.engine_tls_certificate = certificate
        node.engine_tls_fingerprint = engine_tls.fingerprint(certificate) if certificate else ""
    # Reachable for the platform only at an address it may call.
    node.engine_reachable = bool(engine.get("reachable")) and bool(node.engine_connect_url)
    if not (engine.get("supervisor") or {}).get("yardstick"):
        # While the engine serves the platform's yardstick, the node still offers (and the
        # catalog shows) what its provider serves.
        node.engine_models = list(engine.get("models") or [])
        node.engine_served = list(engine.get("served") or [])
    node.engine_error = (refusal or engine.get("error") or "")[:256]
    engine_changed = _engine_process_store(node, engine.get("supervisor"), now=now)
    node.last_heartbeat_at = now
    if changed:
        node.hardware_changed_at = now
        catalog_choices_forget()  # a GPU renamed, gone or back
    if not was_online:
        if NodeStatusChange.objects.filter(node=node, status=Node.Status.OFFLINE).exists():
            alerts.node_back(node=node, now=now)  # back, not a machine's first report
        node.status, node.status_changed_at = Node.Status.ONLINE, now
        NodeStatusChange.objects.create(node=node, status=Node.Status.ONLINE, at=now)
    node.save(update_fields=[name for name in _NODE_REPORTED
                             if getattr(node, name) != before[name]])

    hour = uptime.hour_floor(now)
    if not _uptime_bump(node.pk, hour):
        # The node row lock serialises this node's heartbeats, so no other writer races here.
        NodeUptimeHour.objects.create(node=node, hour=hour, heartbeats=1)
    if first_report or not was_online:
        # Its reliability shows at once; the beat refreshes every node's each minute.
        node.reliability_pct = nodes_refresh_reliability(node_ids=[node.pk], now=now)[node.pk]
    conflicts_changed = uuid_conflicts_refresh(node=node, now=now, cards=cards)
    if changed or first_report or not was_online:
        # This node's GPUs changed, or it is back and holds its UUIDs again: the nodes sharing
        # a UUID with it are judged again at their next heartbeat, not from a repeated answer.
        node_heartbeat_forget(node_ids=_uuid_neighbours(node))
    return HeartbeatResult(node=node, hardware_changed=changed, first_report=first_report,
                           uuid_conflicts_changed=conflicts_changed,
                           engine_changed=engine_changed and not first_report)


def _uptime_bump(node_id: int, hour: datetime) -> bool:
    """One more heartbeat in the node's hour, if its bucket exists (a statement written once:
    the ORM's update() would compile it at every heartbeat)."""
    with connection.cursor() as cursor:
        cursor.execute(_UPTIME_BUMP, [node_id, connection.ops.adapt_datetimefield_value(hour)])
        return cursor.rowcount == 1


_UPTIME_BUMP = (f"UPDATE {NodeUptimeHour._meta.db_table} SET heartbeats = heartbeats + 1 "
                "WHERE node_id = %s AND hour = %s")


def _engine_process_store(node: Node, report: dict | None, *, now: datetime) -> bool:
    """Keep what the agent says of the engine it runs (`engine.supervisor`; none where the
    provider runs it). True when the engine has just become ready with a command other than
    the one it last became ready with: a new configuration, which verification measures again
    (a restart with the same command is not one)."""
    state = report["state"] if report else ""
    if state != node.engine_state:
        node.engine_state, node.engine_state_since = state, now
    node.engine_process = dict(report) if report else {}
    if state != "ready" or (report or {}).get("yardstick"):
        return False  # the platform's yardstick is not the provider's configuration
    digest = hashlib.sha256(json.dumps(report["argv"]).encode()).hexdigest()[:16]
    changed, node.engine_ready_digest = digest != node.engine_ready_digest, digest
    return changed


def node_engine_restart_request(*, node_id: int, owner: User,
                                now: datetime | None = None) -> bool:
    """The owner asks the agent to restart the engine it runs: the count the heartbeat reply
    carries grows, and the agent restarts (draining first) when it sees it. False when the
    node is not the owner's or its agent does not run the engine."""
    now = now or timezone.now()
    with transaction.atomic():
        asked = Node.objects.filter(pk=node_id, owner=owner, credential_revoked_at__isnull=True
                                    ).exclude(engine_state="").update(
            engine_restarts_requested=F("engine_restarts_requested") + 1,
            engine_restart_requested_at=now)
        if asked:
            node_heartbeat_forget(node_ids=[node_id])  # the next answer carries the request
    return bool(asked)


# --- engine keys (engine_keys.py) ---

def node_engine_key_sync(*, node: Node, held: str | None, in_use: str | None,
                         hand_over: bool = True) -> dict | None:
    """A heartbeat's word on the engine key: `held`, the fingerprint of the key the agent
    holds; `in_use`, that of the key its engine runs with (None: not known, no key). The key
    the engine runs with becomes the one the platform sends; a node without a key (one enrolled
    before engine keys) is issued one. The answer: {"key", "fingerprint"} for an agent that
    does not hold the newest key yet (and takes keys: `hand_over`), else None. `node` as the
    heartbeat's authentication read it: the usual heartbeat, nothing to do, costs no query."""
    if (not node.engine_key_next and held is not None and held == node.engine_key_fingerprint
            and engine_keys.unseal(node.engine_key_sealed)):
        return None
    current = engine_keys.unseal(node.engine_key_sealed)
    wanted = engine_keys.unseal(node.engine_key_next)
    if _engine_key_moves(node, current, wanted, in_use):
        current, wanted = _engine_key_move(node.pk, in_use)
    newest = wanted or current
    if not hand_over or held == engine_keys.fingerprint(newest):
        return None
    return {"key": newest, "fingerprint": engine_keys.fingerprint(newest)}


def _engine_key_moves(node: Node, current: str, wanted: str, in_use: str | None) -> bool:
    """Whether the node's key columns change on this word from its agent."""
    return bool((wanted and in_use and in_use == engine_keys.fingerprint(wanted))
                or (current and node.engine_key_fingerprint != engine_keys.fingerprint(current))
                or (not current and not wanted))


def _engine_key_move(node_id: int, in_use: str | None) -> tuple[str, str]:
    """Write what the agent's word changes, under the node's lock: (current, wanted) after."""
    with transaction.atomic():
        node = _lock_node(node_id)
        current = engine_keys.unseal(node.engine_key_sealed)
        wanted = engine_keys.unseal(node.engine_key_next)
        fields = []
        if wanted and in_use and in_use == engine_keys.fingerprint(wanted):
            # The agent's engine has the new key: from now on the platform sends it.
            node.engine_key_sealed, node.engine_key_fingerprint = node.engine_key_next, in_use
            node.engine_key_next, current, wanted = "", wanted, ""
            fields += ["engine_key_sealed", "engine_key_fingerprint", "engine_key_next"]
        elif current and node.engine_key_fingerprint != engine_keys.fingerprint(current):
            node.engine_key_fingerprint = engine_keys.fingerprint(current)
            fields.append("engine_key_fingerprint")
        if not current and not wanted:  # none yet, or sealed under another SECRET_KEY
            wanted = engine_keys.issue()
            node.engine_key_next = engine_keys.seal(wanted)
            fields.append("engine_key_next")
        if fields:
            node.save(update_fields=fields)
    return current, wanted


def engine_keys_reseal() -> int:
    """Seal again under SECRET_KEY every engine key a fallback sealed (after SECRET_KEY
    rotated): the keys themselves do not change, so no engine restarts. Returns how many."""
    resealed = 0
    rows = Node.objects.exclude(engine_key_sealed="", engine_key_next="").values_list(
        "pk", "engine_key_sealed", "engine_key_next")
    for pk, sealed, sealed_next in rows.iterator():
        fields = {name: fresh for name, fresh in (
            ("engine_key_sealed", engine_keys.reseal(sealed)),
            ("engine_key_next", engine_keys.reseal(sealed_next))) if fresh is not None}
        # Only where the row still holds what was read: a key rotated meanwhile stays.
        if fields and Node.objects.filter(pk=pk, engine_key_sealed=sealed,
                                          engine_key_next=sealed_next).update(**fields):
            resealed += len(fields)
    return resealed


def node_engine_key_rotate(*, node_id: int, owner: User | None = None) -> bool:
    """A new engine key for the node (its owner's or, without `owner`, an operator's request).
    The current one stays the key the platform sends until the agent reports its engine runs
    with the new one (node_engine_key_sync): the agent drains the engine and restarts it with
    the new key, so no request in flight is dropped. False when the node is not the owner's."""
    rows = Node.objects.filter(pk=node_id, credential_revoked_at__isnull=True)
    if owner is not None:
        rows = rows.filter(owner=owner)
    with transaction.atomic():
        rotated = rows.update(engine_key_next=engine_keys.seal(engine_keys.issue()))
        if rotated:
            node_heartbeat_forget(node_ids=[node_id])  # the next answer carries the new key
    return bool(rotated)


def node_engine_key_enforced(*, enforced: dict[int, bool]) -> None:
    """What the health checks saw: whether each engine refused a request without the key."""
    for value in (True, False):
        ids = [pk for pk, seen in enforced.items() if seen is value]
        if ids:
            Node.objects.filter(pk__in=ids).exclude(engine_key_enforced=value).update(
                engine_key_enforced=value)


# --- the heartbeat fast path (heartbeat_fast: a repeated report answered from Redis) ---

def node_heartbeat_remember(*, node: Node, generation: str | None, report: bytes,
                            answer: bytes) -> bool:
    """After a full heartbeat whose answer a repeat of the same report would get again: let
    the fast path answer those repeats with `answer` until the entry expires or is forgotten.
    `generation` is heartbeat_fast.generation() read before anything the answer depends on."""
    if generation is None:
        return False
    return heartbeat_fast.remember(prefix=node.credential_prefix, generation=generation,
                                   node_id=node.pk, credential_digest=node.credential_digest,
                                   body=report, answer=answer)


def node_heartbeat_forget(*, node_ids) -> None:
    """The answer these nodes' agents get may change (revoked, marked offline, a job queued, a
    hold put or lifted, a GPU UUID conflict opening or closing): their next heartbeat takes
    the full path. Call it wherever such a change is written; it acts once the transaction
    commits (at once outside one), so a heartbeat that reads the old state meanwhile cannot
    store it again."""
    node_ids = list(node_ids)
    if node_ids and heartbeat_fast.enabled():
        # Read now: a node being deleted is gone by then.
        prefixes = list(Node.objects.filter(pk__in=node_ids)
                        .values_list("credential_prefix", flat=True))
        transaction.on_commit(lambda: heartbeat_fast.forget(prefixes))


def _held_against(node_id: int) -> list[int]:
    """Nodes kept out because this one holds a GPU UUID they report."""
    return list(UuidConflict.objects.filter(incumbent_id=node_id, closed_at__isnull=True)
                .values_list("node_id", flat=True))


def _uuid_neighbours(node: Node) -> set[int]:
    """Nodes whose UUID verdict may follow this node's GPUs: those it holds a UUID against,
    and those reporting a UUID it reports."""
    uuids = list(node.cards.filter(present=True).exclude(uuid="").values_list("uuid", flat=True))
    sharing = (Card.objects.filter(uuid__in=uuids, present=True).exclude(node=node)
               .values_list("node_id", flat=True)) if uuids else []
    return set(_held_against(node.pk)) | set(sharing)


def heartbeats_flush() -> int:
    """Move the heartbeats the fast path counted in Redis into PostgreSQL: each node's latest
    one into Node.last_heartbeat_at (never moving it back) and the hourly counts into
    NodeUptimeHour (added), in one transaction. Returns the nodes moved.

    Redis hands them over in one atomic step (heartbeat_fast.take), so a heartbeat counted
    meanwhile waits for the next flush and two flushes never take the same one; a flush that
    fails to store them gives them back. A node whose row a full heartbeat holds is not waited
    for (a flush waiting on one row would hold up the heartbeats of every row it has locked):
    its share goes back to Redis for the next flush. A node deleted meanwhile is dropped."""
    if not heartbeat_fast.enabled():
        return 0
    try:
        times, counts = heartbeat_fast.take()
    except REDIS_ERRORS:
        log.warning("heartbeat flush: Redis is away; nothing to move")
        return 0
    if not times and not counts:
        return 0
    node_ids = sorted(set(times) | {node_id for node_id, _ in counts})
    node_table, hour_table = Node._meta.db_table, NodeUptimeHour._meta.db_table
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SELECT id FROM {node_table} WHERE id = ANY(%s::bigint[])"
                           " ORDER BY id FOR NO KEY UPDATE SKIP LOCKED", [node_ids])
            held = {row[0] for row in cursor.fetchall()}
            cursor.execute(f"SELECT id FROM {node_table} WHERE id = ANY(%s::bigint[])",
                           [[n for n in node_ids if n not in held]])
            busy = {row[0] for row in cursor.fetchall()}
            now_times = {n: at for n, at in times.items() if n in held}
            now_counts = {key: c for key, c in counts.items() if key[0] in held}
            if now_times:
                cursor.execute(
                    f"""UPDATE {node_table} AS n SET last_heartbeat_at = v.at
                        FROM (SELECT id, to_timestamp(unix) AS at
                              FROM unnest(%s::bigint[], %s::double precision[]) AS t(id, unix)
                             ) AS v
                        WHERE n.id = v.id
                          AND (n.last_heartbeat_at IS NULL OR n.last_heartbeat_at < v.at)""",
                    [list(now_times), list(now_times.values())])
            if now_counts:
                cursor.execute(
                    f"""INSERT INTO {hour_table} (node_id, hour, heartbeats)
                        SELECT node_id, to_timestamp(hour), n
                        FROM unnest(%s::bigint[], %s::bigint[], %s::integer[])
                             AS c(node_id, hour, n)
                        ON CONFLICT (node_id, hour)
                        DO UPDATE SET heartbeats = {hour_table}.heartbeats + EXCLUDED.heartbeats""",
                    [[n for n, _ in now_counts], [h for _, h in now_counts],
                     list(now_counts.values())])
    except BaseException:
        _heartbeats_give_back(times, counts, "PostgreSQL failed to store them")
        raise
    # A node revoked or marked offline while Redis was away kept its entry (the forget could
    # not reach Redis): its agent must get the full path's answer from its next heartbeat on.
    stale = list(Node.objects.filter(pk__in=held).filter(
        Q(credential_revoked_at__isnull=False) | ~Q(status=Node.Status.ONLINE))
        .values_list("pk", flat=True))
    node_heartbeat_forget(node_ids=stale)
    if busy:
        _heartbeats_give_back({n: at for n, at in times.items() if n in busy},
                              {key: c for key, c in counts.items() if key[0] in busy},
                              "their nodes' rows were busy")
    return len(held)


def _heartbeats_give_back(times: dict, counts: dict, why: str) -> None:
    try:
        heartbeat_fast.give_back(times, counts)
    except REDIS_ERRORS:
        log.error("heartbeat flush: the fast heartbeats of %d nodes are lost (%s, then Redis "
                  "could not take them back)", len(set(times) | {n for n, _ in counts}), why)


# --- GPU identity ---

# A node that has not heartbeat for this long no longer holds its GPUs' UUIDs: a machine taken
# apart must not keep its GPU off the market for ever. It holds them again when it returns,
# for it reported them first.
UUID_RELEASE_AFTER = timedelta(days=7)


def uuid_conflicts_refresh(*, node: Node, now: datetime | None = None,
                           cards: list[Card] | None = None) -> bool:
    """Open or close this node's UuidConflicts from what every node reports now; returns
    whether any opened or closed. Called with the node's row locked (its heartbeat).

    The first node to report a UUID holds it while it still reports it, is not revoked, and
    has heartbeat within UUID_RELEASE_AFTER; any other node reporting that UUID is the
    newcomer: flagged (`uuid_conflict`) and kept out of the catalog and shared traffic. The
    incumbent is never flagged by a newcomer, so copying a UUID cannot take a competitor off
    the market. The flag clears itself when the conflict is gone: the newcomer stops
    reporting the UUID, or the incumbent lets go of it. `cards`: the node's cards as its
    heartbeat just stored them (read here otherwise). A node with no conflict open and no
    UUID held by another costs one query."""
    now = now or timezone.now()
    if cards is None:
        cards = list(node.cards.all())
    mine = {c.uuid: c for c in cards if c.present and c.uuid}
    if not node.uuid_conflict and not (mine and _uuids_shared(node.pk, list(mine))):
        return False  # none open (the flag says whether any is), nobody else reports its GPUs
    holders = (Card.objects.filter(uuid__in=list(mine), present=True,
                                   node__credential_revoked_at__isnull=True,
                                   node__last_heartbeat_at__gte=now - UUID_RELEASE_AFTER)
               .exclude(node=node).order_by("first_seen_at", "pk")
               .values_list("uuid", "node_id", "first_seen_at", "pk")) if mine else []
    held_by: dict[str, int] = {}
    for uuid, holder_node, first_seen, pk in holders:
        card = mine[uuid]
        if uuid not in held_by and (first_seen, pk) < (card.first_seen_at, card.pk):
            held_by[uuid] = holder_node
    if not held_by and not node.uuid_conflict:
        return False  # none to open, none open (the flag says whether any is)
    changed = False
    for conflict in UuidConflict.objects.filter(node=node, closed_at__isnull=True):
        if held_by.get(conflict.uuid) != conflict.incumbent_id:
            why = ("this machine no longer reports the GPU" if conflict.uuid not in mine else
                   f"node #{conflict.incumbent_id} no longer holds it")
            UuidConflict.objects.filter(pk=conflict.pk).update(closed_at=now,
                                                               closed_because=why)
            changed = True
        else:
            held_by.pop(conflict.uuid)  # open already
    for uuid, incumbent in held_by.items():
        UuidConflict.objects.create(uuid=uuid, node=node, incumbent_id=incumbent, opened_at=now)
        log.warning("GPU %s reported by node #%s is held by node #%s: node #%s kept out",
                    uuid, node.pk, incumbent, node.pk)
        changed = True
    flagged = UuidConflict.objects.filter(node=node, closed_at__isnull=True).exists()
    if flagged != node.uuid_conflict:
        Node.objects.filter(pk=node.pk).update(uuid_conflict=flagged)
        node.uuid_conflict = flagged
    return changed


_SHARED: dict[int, Prepared] = {}  # by the number of UUIDs: compiled once each


def _uuids_shared(node_id: int, uuids: list[str]) -> bool:
    """Whether another node's present card reports one of these UUIDs."""
    prepared = _SHARED.get(len(uuids))
    if prepared is None:
        prepared = _SHARED.setdefault(len(uuids), Prepared(
            lambda node_id, *uuids: Card.objects.filter(uuid__in=uuids, present=True)
            .exclude(node_id=node_id).order_by().only("pk")[:1], int, *[str] * len(uuids)))
    return bool(prepared(node_id, *uuids))


def nodes_mark_offline(*, now: datetime | None = None) -> list[int]:
    """Mark offline every online node that missed its last N heartbeats, counting those the
    fast path has not flushed yet."""
    heartbeats_flush()
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.RIGSHARE_HEARTBEAT_INTERVAL_S
                             * settings.RIGSHARE_OFFLINE_AFTER_MISSED)
    marked = []
    for node_id in Node.objects.filter(status=Node.Status.ONLINE,
                                       last_heartbeat_at__lt=cutoff).values_list("pk", flat=True):
        with transaction.atomic():
            # Compare-and-set: a heartbeat that lands meanwhile wins and the node stays online.
            if Node.objects.filter(pk=node_id, status=Node.Status.ONLINE,
                                   last_heartbeat_at__lt=cutoff).update(
                    status=Node.Status.OFFLINE, status_changed_at=now):
                NodeStatusChange.objects.create(node_id=node_id, status=Node.Status.OFFLINE,
                                                at=now)
                marked.append(node_id)
    node_heartbeat_forget(node_ids=marked)  # back online only through a full heartbeat
    alerts.nodes_offline(node_ids=marked, now=now)
    return marked


def nodes_refresh_reliability(*, node_ids: list[int] | None = None,
                              now: datetime | None = None) -> dict[int, Decimal]:
    """Recompute reliability over the window (or since enrolment) from the uptime buckets;
    returns each node's."""
    now = now or timezone.now()
    interval = settings.RIGSHARE_HEARTBEAT_INTERVAL_S
    window_start = now - timedelta(days=settings.RIGSHARE_RELIABILITY_WINDOW_DAYS)
    nodes = Node.objects.all() if node_ids is None else Node.objects.filter(pk__in=node_ids)
    created = dict(nodes.values_list("pk", "created_at"))
    credited: dict[int, int] = dict.fromkeys(created, 0)
    rows = (NodeUptimeHour.objects.filter(node_id__in=created, hour__gte=uptime.hour_floor(
        window_start)).values_list("node_id", "heartbeats"))
    for node_id, heartbeats in rows:
        credited[node_id] += uptime.credited_seconds(heartbeats, interval)
    updates = []
    for node_id, created_at in created.items():
        window = (now - max(created_at, window_start)).total_seconds()
        updates.append(Node(pk=node_id,
                            reliability_pct=uptime.reliability_pct(credited[node_id], window)))
    Node.objects.bulk_update(updates, ["reliability_pct"], batch_size=500)
    return {row.pk: row.reliability_pct for row in updates}


# --- listings ---

def listing_update(*, owner: User, card_id: int, is_listed: bool, price_per_hour_micros: int,
                   claimed_gpu_model: str = "", claimed_vram_gb: int | None = None,
                   description: str = "") -> Listing:
    with transaction.atomic():
        card = _lock_card(card_id)
        if card.node.owner_id != owner.pk:
            raise Card.DoesNotExist
        if is_listed and price_per_hour_micros <= 0:
            raise MarketplaceError("Set a price above zero before listing the card.")
        if is_listed and (not card.present or card.node.credential_revoked_at):
            raise MarketplaceError("This card is no longer reported by its machine.")
        listing = card.listing
        if listing.is_listed != is_listed:
            catalog_choices_forget()
        listing.is_listed = is_listed
        listing.price_per_hour_micros = price_per_hour_micros
        listing.cost_per_mtok_micros = costs.per_mtok_micros(price_per_hour_micros,
                                                             card.verified_tokens_per_s)
        listing.claimed_gpu_model = claimed_gpu_model
        listing.claimed_vram_gb = claimed_vram_gb
        listing.description = description
        listing.save()
        return listing


def listing_costs_refresh(*, card_ids) -> int:
    """Work out the cost per 1M output tokens of these cards' listings again, from their price
    and the card's verified tokens/s (after either changed outside listing_update)."""
    rows = list(Listing.objects.filter(card_id__in=list(card_ids))
                .values_list("pk", "price_per_hour_micros", "card__verified_tokens_per_s",
                             "cost_per_mtok_micros"))
    changed = 0
    for pk, price, tokens_per_s, stored in rows:
        cost = costs.per_mtok_micros(price, tokens_per_s)
        if cost != stored:
            changed += Listing.objects.filter(pk=pk).update(cost_per_mtok_micros=cost)
    return changed


# --- rentals ---

class FlaggedCardNotAccepted(RentalRefused):
    """Verification flagged the card: the renter must say they read its findings."""


@transaction.atomic
def rental_start(*, renter: User, card_id: int, hours: int | None = None,
                 accept_flagged: bool = False, now: datetime | None = None) -> Rental:
    """Rent a card until stopped or for `hours`. Of two renters at once exactly one wins. A
    card that verification flagged is rented only with `accept_flagged`: its findings say it
    is not what it claims, and the renter must have been told."""
    now = now or timezone.now()
    try:
        card = _lock_card(card_id)
    except Card.DoesNotExist:
        raise RentalRefused("This card does not exist.") from None
    listing = getattr(card, "listing", None)
    if listing is None or not listing.is_listed or not card.present:
        raise RentalRefused("This card is not for rent.")
    if card.node.owner_id == renter.pk:
        raise RentalRefused("You cannot rent your own card.")
    if not card.node.is_online:
        raise RentalRefused("This card's machine is offline right now.")
    if card.node.held_out:
        raise RentalRefused("This card's machine is under review.")
    if card.verification_status == Card.Verification.FLAGGED and not accept_flagged:
        raise FlaggedCardNotAccepted(
            "Verification flagged this card: it measured below what it claims. Read the "
            "findings, then confirm that you rent it anyway.")
    if Rental.objects.filter(card=card, stopped_at__isnull=True).exists():
        raise RentalRefused("Someone else has just rented this card.")
    if hours is not None and not 1 <= hours <= 24 * 90:
        raise RentalRefused("Choose between 1 and 2,160 hours.")
    if wallet_balance(renter.pk) < pricing.rental_due_micros(listing.price_per_hour_micros,
                                                            MIN_PREPAID_S):
        raise RentalRefused("Top up first: your balance must cover at least 10 minutes of "
                            "this card.")
    try:
        # The card lock serialises renters; the partial unique index is the last word.
        with transaction.atomic():
            # The node is online and the card is the renter's from now: charging starts here.
            return Rental.objects.create(
                card=card, renter=renter, price_per_hour_micros=listing.price_per_hour_micros,
                started_at=now, ready_at=now, charged_until=now,
                ends_at=now + timedelta(hours=hours) if hours else None)
    except IntegrityError:
        raise RentalRefused("Someone else has just rented this card.") from None


def rental_stop(*, rental_id: int, renter: User | None = None,
                reason: str = Rental.StopReason.REQUESTED,
                now: datetime | None = None) -> Rental:
    """Stop an active rental at `now` (or at its booked end if that came first) and charge
    it up to that moment."""
    now = now or timezone.now()
    with transaction.atomic():
        rental = Rental.objects.select_for_update().get(
            pk=rental_id, **({"renter": renter} if renter else {}))
        if rental.stopped_at is None:
            end = min(now, rental.ends_at) if rental.ends_at else now
            rental.stopped_at, rental.stop_reason = end, reason
            rental.save(update_fields=["stopped_at", "stop_reason"])
    return rental_charge(rental_id=rental.pk, now=now)


MIN_PREPAID_S = 600  # a rental starts only if the balance covers this; below it, a warning


def rental_charge(*, rental_id: int, now: datetime | None = None) -> Rental:
    """Charge a rental for the seconds since its last charge, less the time its node was
    offline. Idempotent: a second call for the same moment charges nothing. When the wallet
    cannot pay, it takes what is left and the rental stops where the money ran out."""
    now = now or timezone.now()
    with transaction.atomic():
        rental = Rental.objects.select_for_update().select_related("card__node").get(
            pk=rental_id)
        start = rental.charged_until or rental.ready_at
        end = min(filter(None, [now, rental.stopped_at, rental.ends_at]))
        if start is None or end <= start:
            return rental
        node = rental.card.node
        before = (NodeStatusChange.objects.filter(node=node, at__lte=start)
                  .order_by("-at").values_list("status", flat=True).first())
        changes = list(NodeStatusChange.objects.filter(node=node, at__gt=start, at__lt=end)
                       .order_by("at").values_list("at", "status"))
        offline = uptime.offline_seconds(changes, status_at_start=before or node.status,
                                         start=start, end=end)
        elapsed = int((end - start).total_seconds())
        billed = rental.billed_seconds + max(0, elapsed - offline)
        amount = pricing.rental_due_micros(rental.price_per_hour_micros, billed) \
            - rental.charged_micros
        charge = billing.time_charge(
            payer_id=rental.renter_id, provider_id=node.owner_id, amount_micros=amount,
            idempotency_key=f"rental:{rental.pk}:{end.isoformat()}",
            reference=card_ref(rental.card_id), now=now)
        rental.charged_micros += charge.charged_micros
        rental.offline_seconds += min(offline, elapsed)
        rental.billed_seconds, rental.charged_until = billed, end
        if charge.exhausted:
            # The seconds the money paid for; the rest of this stretch was never paid.
            paid = ((rental.charged_micros + 1) * 3600 - 1) // rental.price_per_hour_micros
            unpaid = max(0, billed - paid)
            rental.billed_seconds = billed - unpaid
            rental.charged_until = end - timedelta(seconds=unpaid)
            if rental.stopped_at is None or rental.stopped_at > rental.charged_until:
                rental.stopped_at = rental.charged_until
                rental.stop_reason = Rental.StopReason.BALANCE
        rental.save()
        return rental


def rentals_charge(*, now: datetime | None = None) -> int:
    """Charge every rental that has time not yet charged (Celery beat, every 30 s)."""
    now = now or timezone.now()
    due = list(Rental.objects.filter(Q(stopped_at__isnull=True)
                                     | Q(stopped_at__gt=F("charged_until")))
               .values_list("pk", flat=True))
    for rental_id in due:
        rental_charge(rental_id=rental_id, now=now)
    return len(due)


def rentals_end_due(*, now: datetime | None = None) -> int:
    """Stop the rentals whose booked hours are over, at exactly their booked end."""
    now = now or timezone.now()
    due = list(Rental.objects.filter(stopped_at__isnull=True, ends_at__lte=now).values_list(
        "pk", flat=True))
    for rental_id in due:
        rental_stop(rental_id=rental_id, reason=Rental.StopReason.EXPIRED, now=now)
    return len(due)



SERVED_CHUNK = 1000


def cards_served_publish(*, by_node: dict[int, dict]) -> int:
    """Routing's live figures of each node's engine (`by_node`: {node id: {"tokens_per_s",
    "ttft_ms", "served"}}) onto its present cards, where the catalog sorts by them and the rent
    page shows them; cards of any other node lose theirs (no traffic left in the last day).
    Returns the nodes written. Runs every minute for the whole fleet: on PostgreSQL one UPDATE
    per SERVED_CHUNK nodes (bulk_update's CASE per row took 2 ms a node, `make bench-served`)."""
    nodes = sorted(by_node)
    with transaction.atomic():
        if connection.vendor == "postgresql":
            table = Card._meta.db_table
            with connection.cursor() as cursor:
                for i in range(0, len(nodes), SERVED_CHUNK):
                    chunk = nodes[i:i + SERVED_CHUNK]
                    values = ", ".join(["(%s::bigint, %s::double precision, "
                                        "%s::double precision, %s::jsonb)"] * len(chunk))
                    params = []
                    for node_id in chunk:
                        f = by_node[node_id]
                        params += [node_id, f.get("tokens_per_s"), f.get("ttft_ms"),
                                   json.dumps(f.get("served") or {})]
                    cursor.execute(
                        f"UPDATE {table} AS c SET served_tokens_per_s = v.tps, "
                        f"served_ttft_ms = v.ttft, served = v.served "
                        f"FROM (VALUES {values}) AS v(node_id, tps, ttft, served) "
                        f"WHERE c.node_id = v.node_id AND c.present", params)
        else:
            cards = list(Card.objects.filter(node_id__in=nodes, present=True)
                         .only("pk", "node_id"))
            for card in cards:
                figures = by_node[card.node_id]
                card.served_tokens_per_s = figures.get("tokens_per_s")
                card.served_ttft_ms = figures.get("ttft_ms")
                card.served = figures.get("served") or {}
            Card.objects.bulk_update(cards, ["served_tokens_per_s", "served_ttft_ms",
                                             "served"])
        Card.objects.exclude(node_id__in=nodes).exclude(served={}).update(
            served={}, served_tokens_per_s=None, served_ttft_ms=None)
    return len(nodes)


def card_verification_publish(*, card_id: int, status: str, tokens_per_s: float | None,
                              reference_spec: str, model: str = "",
                              concurrency: int | None = None,
                              bandwidth_gbs: float | None = None,
                              spec_bandwidth_gbs: int | None = None,
                              problems: int = 0, single_tokens_per_s: float | None = None,
                              power_idle_w: float | None = None,
                              power_loaded_w: float | None = None) -> None:
    """Verification's verdict on a card, as the catalog and rent page show it: `tokens_per_s`
    is the card's share of its engine's output serving `model` at `concurrency` requests
    (`single_tokens_per_s`: one request alone), and the GPU's draw idle and at that
    concurrency. The listing's cost per 1M tokens follows. A card newly flagged raises an
    alert to its provider."""
    newly_flagged = status == Card.Verification.FLAGGED and Card.objects.filter(
        pk=card_id).exclude(verification_status=status).exists()
    with transaction.atomic():
        Card.objects.filter(pk=card_id).update(
            verification_status=status, verified_tokens_per_s=tokens_per_s,
            verified_model=model, verified_concurrency=concurrency,
            reference_spec=reference_spec, bandwidth_gbs=bandwidth_gbs,
            spec_bandwidth_gbs=spec_bandwidth_gbs, verification_problems=problems,
            verified_single_tokens_per_s=single_tokens_per_s, power_idle_w=power_idle_w,
            power_loaded_w=power_loaded_w)
        listing_costs_refresh(card_ids=[card_id])
    if newly_flagged:
        alerts.card_flagged(card=Card.objects.select_related("node").get(pk=card_id))
