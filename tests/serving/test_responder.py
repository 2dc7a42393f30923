"""backend/serving/responder.py: the engine model's responses leave from one thread, in the order
they were handed over, and a failed delivery does not stop the ones after it."""
import threading

from backend.serving.responder import Responder


def test_responses_go_out_in_order_from_one_thread_and_drain_waits_for_them():
    r = Responder()
    sent, threads, gate = [], set(), threading.Event()

    def deliver(i):
        def send():
            gate.wait(10)   # the first delivery holds the thread: the rest must queue behind it
            threads.add(threading.current_thread().name)
            sent.append(i)
        return send
    for i in range(50):
        r.submit(deliver(i))
    assert sent == []   # submit never waits for a delivery
    gate.set()
    assert r.drain(timeout=10)
    assert sent == list(range(50)) and threads == {"kiln-responder"}
    assert r.close(timeout=10)
    assert not r.drain(timeout=1)   # closed: nothing would ever be sent


def test_a_failed_delivery_does_not_stop_the_later_ones():
    r = Responder()
    sent = []

    def broken():
        raise RuntimeError("client gone")
    r.submit(lambda: sent.append(1))
    r.submit(broken)
    r.submit(lambda: sent.append(2))
    assert r.close(timeout=10)   # close sends what was queued first
    assert sent == [1, 2]
