"""torch objects and pure pieces (mechanism band): nested state dicts to dotted names and back
(``flatten``), tensors / DTensors / ``GlobalPiece`` to ``PieceSpec`` (``pieces``), dtypes,
``Stateful`` values, and ``torch_private``: the only module that touches torch's private names."""
