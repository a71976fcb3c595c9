"""Several models behind one address: a front that owns no model and runs one
`llamaserve serve` process per loaded model, loading on demand and unloading the least
recently used or idle ones (docs/several-models.md)."""
