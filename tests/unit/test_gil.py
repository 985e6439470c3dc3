"""memkv_vllm.gil: the switch interval the integrations lower while their threads have work.

Claims: a holder lowers CPython's switch interval to its own while it holds and the interval
found before comes back when it lets go; several holders in one process lower it together (the
smallest wins) and only the last to let go puts it back; a holder never raises it; a change
made by someone else while held is left alone; 0 never holds; close() lets go.
"""

from __future__ import annotations

import sys

import pytest

from memkv_vllm.gil import SwitchInterval

pytestmark = pytest.mark.unit

START = 0.005  # CPython's default


@pytest.fixture(autouse=True)
def switch_interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(START)
    yield
    sys.setswitchinterval(saved)


def test_a_holder_lowers_the_interval_while_it_holds_and_puts_it_back():
    s = SwitchInterval(0.001)
    s.hold(False)
    assert sys.getswitchinterval() == pytest.approx(START)
    s.hold(True)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    s.hold(True)  # every step: no change
    assert sys.getswitchinterval() == pytest.approx(0.001)
    s.hold(False)
    assert sys.getswitchinterval() == pytest.approx(START)


def test_holders_share_the_interval_and_the_last_one_puts_it_back():
    a, b = SwitchInterval(0.002), SwitchInterval(0.0005)
    a.hold(True)
    b.hold(True)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    b.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.002)
    b.hold(True)
    a.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    b.close()
    assert sys.getswitchinterval() == pytest.approx(START)


def test_a_holder_never_raises_the_interval():
    s = SwitchInterval(0.05)
    s.hold(True)
    assert sys.getswitchinterval() == pytest.approx(START)
    s.hold(False)
    assert sys.getswitchinterval() == pytest.approx(START)


def test_an_interval_someone_else_set_meanwhile_is_left_alone():
    s = SwitchInterval(0.001)
    s.hold(True)
    sys.setswitchinterval(0.003)
    s.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.003)
    s.hold(True)  # a later hold starts from the interval it finds
    s.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.003)


def test_zero_never_holds():
    s = SwitchInterval(0.0)
    s.hold(True)
    assert not s.held and sys.getswitchinterval() == pytest.approx(START)
