"""Prefill/decode disaggregation: the prefill and decode workers' protocol (`pd.py`) and the
hand-over's wire format (`wire.py`). The remote store they share is `oasiskv.store`."""
