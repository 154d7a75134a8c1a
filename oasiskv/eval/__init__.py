"""Measuring tools users run (`oasiskv eval ...`): how good the predictions are, not how fast."""
