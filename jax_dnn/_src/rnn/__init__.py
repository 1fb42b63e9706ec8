"""Recurrent networks: LSTM, GRU and Elman RNN (tanh or relu); multi-layer,
bidirectional, ragged lengths.

Letters: T time steps, B batch, I input features, H hidden features, G gates
(LSTM 4: i, f, g, o; GRU 3: r, z, n; RNN 1), S state slots, L layers,
D directions (2 when bidirectional), P = L * D pseudo-layers (forward 0,
reverse 0, forward 1, ...).

The modules, in the order a call meets them:
  layers      the public ops (lstm, gru, rnn): checks, the layers' loop;
  weights     the flat weight layout, its initializers and PyTorch's names;
  recurrence  one layer's recurrence: references, primitives, custom VJP.
"""
