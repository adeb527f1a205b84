"""The functional core: the decoder and its loop state, acceptance rules, sampling, window trees and
slot operations. Pure functions over arrays with static shapes; nothing here knows a host."""
