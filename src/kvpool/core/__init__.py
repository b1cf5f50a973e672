"""Pure building blocks shared by every component: types, errors, protocol. No I/O, no imports of ours."""
