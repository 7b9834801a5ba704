"""Read a cubin (an ELF64 file) far enough to compare the generated code of two builds.

Two cubins can differ in bytes while their kernels are the same code: symbol tables list a different
number of unused constants, so every symbol index shifts. :func:`code_of` keeps what the GPU runs
-- each function's instructions, and each relocation with its symbol by name -- and nothing that
only counts or orders symbols.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_ELF_SECTIONS_AT = struct.Struct("<Q")  # e_shoff, at byte 0x28
_ELF_SECTION_COUNTS = struct.Struct("<HHH")  # e_shentsize, e_shnum, e_shstrndx, at byte 0x3A
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, section index, value, size
_RELA = struct.Struct("<QQq")  # offset, info (symbol << 32 | type), addend
_SHT_RELA, _SHT_NOBITS = 4, 8


class Section(NamedTuple):
    name: str
    kind: int
    link: int
    body: bytes


def _c_string(data: bytes, offset: int) -> str:
    return data[offset:data.index(b"\0", offset)].decode()


def sections(cubin: bytes) -> list[Section]:
    """Every section in index order."""
    (table_at,) = _ELF_SECTIONS_AT.unpack_from(cubin, 0x28)
    entry_size, count, names_index = _ELF_SECTION_COUNTS.unpack_from(cubin, 0x3A)
    headers = [_SECTION_HEADER.unpack_from(cubin, table_at + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]
    return [Section(_c_string(cubin, names_at + h[0]), h[1], h[6],
                    b"" if h[1] == _SHT_NOBITS else cubin[h[4]:h[4] + h[5]]) for h in headers]


def _symbol_names(all_sections: list[Section]) -> list[str]:
    symtab = next(s for s in all_sections if s.name == ".symtab")
    strings = all_sections[symtab.link].body
    return [_c_string(strings, _SYMBOL.unpack_from(symtab.body, i)[0])
            for i in range(0, len(symtab.body), _SYMBOL.size)]


def code_of(cubin: bytes) -> dict[str, object]:
    """Each ``.text.<function>`` section's bytes and its relocations as (offset, type, symbol name, addend)."""
    all_sections = sections(cubin)
    names = _symbol_names(all_sections)
    code: dict[str, object] = {}
    for section in all_sections:
        if section.name.startswith(".text."):
            code[section.name] = section.body
        elif section.kind == _SHT_RELA and section.name.startswith(".rela.text."):
            entries = (_RELA.unpack_from(section.body, i) for i in range(0, len(section.body), _RELA.size))
            code[section.name] = sorted((offset, info & 0xFFFFFFFF, names[info >> 32], addend)
                                        for offset, info, addend in entries)
    return code
