"""The router passes a worker's error on with its status and body; a 503 keeps its
Retry-After even when it came as a stream's error event (no headers to copy)."""

from oasiskv.serve.router import _relayed


def test_a_relayed_503_tells_the_client_when_to_retry():
    body = b'{"error": {"message": "the store is full (capacity 4 blocks)", "code": 503}}'
    err = _relayed(503, body)
    assert (err.status, err.message) == (503, "the store is full (capacity 4 blocks)")
    assert err.headers == {"Retry-After": "1"}


def test_other_relayed_errors_carry_no_retry_after():
    err = _relayed(400, b'{"error": {"message": "max_tokens must be positive"}}')
    assert (err.status, err.headers) == (400, {})
    assert "worker answered 500" in _relayed(500, b"<html>").message
