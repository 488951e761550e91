"""``opt.state``'s store and the pure checkpoint format (pack, validate, merge)."""
