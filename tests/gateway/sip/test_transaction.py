"""Server/client transaction state tables (RFC 3261 §17, RFC 6026) driven with a fake clock."""

from __future__ import annotations

import pytest

from gateway.sip.agent import Flow, _response
from gateway.sip.message import SipRequest, SipResponse, parse_message
from gateway.sip.transaction import (
    AnswerRetransmission,
    InviteServerTransaction,
    NonInviteClientTransaction,
    NonInviteServerTransaction,
    TimedOut,
    TimerConfig,
    TransactionStateError,
    Transmit,
    TxState,
    server_key,
)
from tests.gateway.sip.factories import invite, request

T = TimerConfig(t1=0.5, t2=4.0, t4=5.0)
FLOW = Flow("udp", ("127.0.0.1", 5070))


def req(data: bytes) -> SipRequest:
    message = parse_message(data)
    assert isinstance(message, SipRequest)
    return message


def resp(request: SipRequest, status: int) -> SipResponse:
    return _response(request, FLOW, status, to_tag="gw" if status > 100 else None)


def run_timers(
    tx: InviteServerTransaction | NonInviteClientTransaction | AnswerRetransmission, until: float
) -> list[tuple[float, object]]:
    """Fire the transaction's timer at each deadline up to `until`; the effects with their times."""
    out: list[tuple[float, object]] = []
    while (d := tx.next_deadline()) is not None and d <= until:
        out += [(d, e) for e in tx.handle_timer(d)]
    return out


def test_invite_2xx_moves_to_accepted_then_terminates_after_timer_l() -> None:
    r = req(invite())
    tx = InviteServerTransaction(r, reliable=False, timers=T, now=0.0)
    assert tx.respond(resp(r, 100), 0.0)
    tx.respond(resp(r, 200), 1.0)
    assert tx.state is TxState.ACCEPTED
    # RFC 6026 §7.1: INVITE retransmissions are absorbed in Accepted.
    assert tx.receive_request(r, 2.0) == []
    assert tx.next_deadline() == pytest.approx(1.0 + 64 * 0.5)
    tx.handle_timer(33.0)
    assert tx.state is TxState.TERMINATED


def test_invite_retransmission_in_proceeding_gets_the_last_provisional() -> None:
    r = req(invite())
    tx = InviteServerTransaction(r, reliable=False, timers=T, now=0.0)
    (first,) = tx.respond(resp(r, 100), 0.0)
    (again,) = tx.receive_request(r, 0.3)
    assert isinstance(first, Transmit) and isinstance(again, Transmit)
    assert again.data == first.data and again.retransmission


def test_error_response_is_retransmitted_by_timer_g_until_ack() -> None:
    r = req(invite())
    tx = InviteServerTransaction(r, reliable=False, timers=T, now=0.0)
    tx.respond(resp(r, 486), 0.0)
    assert tx.state is TxState.COMPLETED
    fired = run_timers(tx, 4.0)
    # G: T1, then doubling: 0.5, 1.5, 3.5 (intervals 0.5, 1, 2).
    assert [t for t, _ in fired] == pytest.approx([0.5, 1.5, 3.5])
    ack = req(request("ACK", branch=r.via[0].branch, cseq=r.cseq.seq))
    assert tx.receive_request(ack, 3.6) == []
    assert tx.state is TxState.CONFIRMED
    assert tx.next_deadline() == pytest.approx(3.6 + 5.0)  # Timer I = T4
    tx.handle_timer(9.0)
    assert tx.state is TxState.TERMINATED


def test_error_response_without_ack_times_out_with_timer_h() -> None:
    r = req(invite())
    tx = InviteServerTransaction(r, reliable=False, timers=T, now=0.0)
    tx.respond(resp(r, 503), 0.0)
    fired = run_timers(tx, 100.0)
    transmits = [e for _, e in fired if isinstance(e, Transmit)]
    assert all(e.retransmission for e in transmits)
    assert fired[-1] == (pytest.approx(32.0), TimedOut("H"))
    assert tx.state is TxState.TERMINATED
    # intervals capped at T2 = 4 s: 0.5 1 2 4 4 4 ... up to 32 s
    assert len(transmits) == 10


def test_reliable_transport_never_retransmits_responses() -> None:
    r = req(invite(transport="TCP"))
    tx = InviteServerTransaction(r, reliable=True, timers=T, now=0.0)
    tx.respond(resp(r, 486), 0.0)
    fired = run_timers(tx, 100.0)
    assert fired == [(pytest.approx(32.0), TimedOut("H"))]


@pytest.mark.parametrize(
    ("state_setup", "status"),
    [(200, 100), (200, 486), (486, 200), (486, 180)],
)
def test_invite_transaction_illegal_transitions_raise_and_leave_state(state_setup: int, status: int) -> None:
    r = req(invite())
    tx = InviteServerTransaction(r, reliable=False, timers=T, now=0.0)
    tx.respond(resp(r, state_setup), 0.0)
    before = tx.state
    refused = rf"^INVITE server transaction: \w+ not allowed in {before.value}$"
    with pytest.raises(TransactionStateError, match=refused):
        tx.respond(resp(r, status), 0.1)
    assert tx.state is before


def test_non_invite_server_answers_retransmissions_with_the_final_then_timer_j() -> None:
    r = req(request("BYE", to_tag="gw"))
    tx = NonInviteServerTransaction(r, reliable=False, timers=T, now=0.0)
    assert tx.receive_request(r, 0.1) == []  # Trying: absorbed
    (sent,) = tx.respond(resp(r, 200), 0.2)
    assert isinstance(sent, Transmit)
    (again,) = tx.receive_request(r, 0.5)
    assert isinstance(again, Transmit) and again.data == sent.data
    assert tx.next_deadline() == pytest.approx(0.2 + 32.0)
    tx.handle_timer(40.0)
    assert tx.state is TxState.TERMINATED
    refused = r"^non-INVITE server transaction: 2xx not allowed in terminated$"
    with pytest.raises(TransactionStateError, match=refused):
        tx.respond(resp(r, 200), 41.0)
    assert tx.state is TxState.TERMINATED


def test_answer_retransmission_doubles_to_t2_until_ack() -> None:
    rtx = AnswerRetransmission(b"200", timers=T, now=0.0)
    fired = run_timers(rtx, 8.0)
    assert [t for t, _ in fired] == pytest.approx([0.5, 1.5, 3.5, 7.5])
    rtx.ack()
    assert rtx.next_deadline() is None
    assert rtx.handle_timer(100.0) == []


def test_answer_retransmission_gives_up_after_64_t1() -> None:
    rtx = AnswerRetransmission(b"200", timers=T, now=0.0)
    fired = run_timers(rtx, 100.0)
    assert fired[-1] == (pytest.approx(32.0), TimedOut("L"))
    assert rtx.expired and rtx.next_deadline() is None


def test_client_bye_retransmits_with_timer_e_and_completes_on_200() -> None:
    bye = req(request("BYE", to_tag="x"))
    tx = NonInviteClientTransaction(bye, reliable=False, timers=T, now=0.0)
    (_first,) = tx.start()
    fired = run_timers(tx, 2.0)
    assert [t for t, _ in fired] == pytest.approx([0.5, 1.5])
    tx.receive_response(resp(bye, 200), 2.0)
    assert tx.state is TxState.COMPLETED
    tx.handle_timer(2.0 + 5.0)
    assert tx.state is TxState.TERMINATED
    assert tx.response is not None and tx.response.status == 200


def test_client_bye_times_out_with_timer_f() -> None:
    bye = req(request("BYE", to_tag="x"))
    tx = NonInviteClientTransaction(bye, reliable=True, timers=T, now=0.0)
    assert run_timers(tx, 100.0) == [(pytest.approx(32.0), TimedOut("F"))]
    assert tx.state is TxState.TERMINATED


def test_server_key_maps_ack_to_invite_and_falls_back_to_rfc2543_matching() -> None:
    r = req(invite(branch="z9hG4bKabc"))
    ack = req(request("ACK", branch="z9hG4bKabc"))
    assert server_key(ack) == server_key(r)
    cancel = req(request("CANCEL", branch="z9hG4bKabc"))
    assert server_key(cancel) != server_key(r)
    assert server_key(cancel, method="INVITE") == server_key(r)
    old = req(invite(branch="z9hG4bK"))  # a bare cookie is not an RFC 3261 branch (RFC 4475 badbranch)
    assert server_key(old)[0] == "2543"
