"""The receiving side: :mod:`.receiver` (fetch and wait, the receiver lock) over its
parts :mod:`.arena`, :mod:`.peers`, :mod:`.transfers`, :mod:`.mapped` (with :mod:`.fork`),
:mod:`.source`, :mod:`.targets` and :mod:`.drain`."""
