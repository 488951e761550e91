"""Constructors that mirror other libraries' offloading optimizers on offloadopt's machinery."""
