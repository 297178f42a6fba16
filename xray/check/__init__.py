"""User-facing checks: `python -m xray.check parity|sync ...` prove a layout or a sync is exact."""
