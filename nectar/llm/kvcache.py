"""A KV cache whose storage is allocated once per batch.

transformers' DynamicCache appends with ``torch.cat``: every decode step copies the whole cache of
every layer (with a long cache, that copy — not the attention — dominated decode time). Here each
layer allocates [b, h_kv, capacity, d] once and every step writes its new key/value in place;
attention reads a view of the filled part, so masks and positions work exactly as with
DynamicCache.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self._k = torch.empty((b, h, self.capacity, dk), dtype=self.dtype, device=self.device)
        self._v = torch.empty((b, h, self.capacity, value_states.shape[-1]), dtype=self.dtype, device=self.device)
        self.is_initialized = True
        self._view()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # more tokens than planned: grow (rare; keeps correctness)
            self._grow(max(end, 2 * self.capacity))
        self._k[:, :, self.length:end] = key_states  # [b, h, n, d]
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._view()

    def _grow(self, capacity: int) -> None:
        k = torch.empty((*self._k.shape[:2], capacity, self._k.shape[-1]), dtype=self.dtype, device=self.device)
        v = torch.empty((*self._v.shape[:2], capacity, self._v.shape[-1]), dtype=self.dtype, device=self.device)
        k[:, :, :self.length], v[:, :, :self.length] = self._k[:, :, :self.length], self._v[:, :, :self.length]
        self._k, self._v, self.capacity = k, v, capacity

    def _view(self) -> None:
        self.keys = self._k[:, :, :self.length]  # [b, h, length, d], no copy
        self.values = self._v[:, :, :self.length]


def preallocated_cache(config, batch: int, capacity: int) -> DynamicCache:
    """A cache for ``batch`` rows and up to ``capacity`` tokens (allocated at the first update)."""
    n_layers = config.get_text_config(decoder=True).num_hidden_layers
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) for _ in range(n_layers)]
    return cache
