"""Read a cubin (an ELF64 file) far enough to compare the generated code of two builds, and to read
each kernel's parameters.

Two cubins can differ in bytes while their kernels are the same code: symbol tables list a different
number of unused constants, so every symbol index shifts. :func:`code_of` keeps what the GPU runs
-- each function's instructions, and each relocation with its symbol by name -- and nothing that
only counts or orders symbols. :func:`kernel_params` reads where each kernel's parameters sit, as
the driver lays out a launch's parameter buffer; :func:`entry_symbols` names the kernels and
:func:`symbol_names` every symbol.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_ELF_SECTIONS_AT = struct.Struct("<Q")  # e_shoff, at byte 0x28
_ELF_SECTION_COUNTS = struct.Struct("<HHH")  # e_shentsize, e_shnum, e_shstrndx, at byte 0x3A
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, section index, value, size
_RELA = struct.Struct("<QQq")  # offset, info (symbol << 32 | type), addend
_INFO_RECORD = struct.Struct("<BB")  # format, attribute: the head of each record of a .nv.info section
_INFO_VALUE = struct.Struct("<H")  # the payload's size (EIFMT_SVAL) or the value (EIFMT_HVAL)
_KPARAM_INFO = struct.Struct("<IHHI")  # index, ordinal, offset, flags (the size in bits 18-31)
_SHT_RELA, _SHT_NOBITS = 4, 8
_STT_FUNC, _STO_CUDA_ENTRY = 2, 0x10  # a symbol's type (low bits of its info); an entry's mark in `other`
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4  # a record's format: no value, u8, u16, sized
_EIATTR_KPARAM_INFO = 0x17  # one kernel parameter (EIFMT_SVAL)
_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F  # a function's stack frame bytes, its registers a thread
_FUNCTION_VALUE = struct.Struct("<II")  # the payload of those two: the function's symbol index, the value
_KERNEL_INFO = ".nv.info."  # a kernel's attributes: section .nv.info.<kernel>


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


def static_shared_bytes(cubin: bytes, kernel: str) -> int:
    """Bytes of static shared memory of entry ``kernel`` (its mangled name): the size of its ``.nv.shared``
    section, which takes no bytes in the file; 0 when it has none."""
    (table_at,) = _ELF_SECTIONS_AT.unpack_from(cubin, 0x28)
    entry_size, count, names_index = _ELF_SECTION_COUNTS.unpack_from(cubin, 0x3A)
    headers = [_SECTION_HEADER.unpack_from(cubin, table_at + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]
    wanted = f".nv.shared.{kernel}"
    return next((h[5] for h in headers if _c_string(cubin, names_at + h[0]) == wanted), 0)


def _symbol_names(all_sections: list[Section]) -> list[str]:
    symtab = next(s for s in all_sections if s.name == ".symtab")
    strings = all_sections[symtab.link].body
    return [_c_string(strings, _SYMBOL.unpack_from(symtab.body, i)[0])
            for i in range(0, len(symtab.body), _SYMBOL.size)]


def symbol_names(cubin: bytes) -> set[str]:
    """Every symbol the cubin's symbol table names (functions, device variables, sections)."""
    return set(_symbol_names(sections(cubin))) - {""}


def entry_symbols(cubin: bytes) -> set[str]:
    """The symbols of the cubin's kernels (its entry functions), as the driver looks them up."""
    all_sections = sections(cubin)
    symtab = next(s for s in all_sections if s.name == ".symtab")
    strings = all_sections[symtab.link].body
    found = set()
    for at in range(0, len(symtab.body), _SYMBOL.size):
        name, info, other, *_ = _SYMBOL.unpack_from(symtab.body, at)
        if info & 0xF == _STT_FUNC and other & _STO_CUDA_ENTRY:
            found.add(_c_string(strings, name))
    return found


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


def _info_records(body: bytes):
    """``(attribute, payload)`` of each record of a ``.nv.info`` section. Records are a format and an
    attribute byte, then: nothing (EIFMT_NVAL); a u8 value and a pad byte (EIFMT_BVAL); a u16 value
    (EIFMT_HVAL); a u16 size and that many bytes (EIFMT_SVAL). The payload of the first three is the
    value's bytes (none for EIFMT_NVAL)."""
    at = 0
    while at < len(body):
        form, attribute = _INFO_RECORD.unpack_from(body, at)
        at += _INFO_RECORD.size
        if form == _EIFMT_NVAL:
            payload = b""
        elif form == _EIFMT_BVAL:
            payload, at = body[at:at + 1], at + 2
        elif form == _EIFMT_HVAL:
            payload, at = body[at:at + 2], at + 2
        elif form == _EIFMT_SVAL:
            (size,) = _INFO_VALUE.unpack_from(body, at)
            payload, at = body[at + 2:at + 2 + size], at + 2 + size
        else:
            raise ValueError(f"unknown .nv.info record format {form:#x} at byte {at - _INFO_RECORD.size}")
        yield attribute, payload


def kernel_params(cubin: bytes) -> dict[str, list[tuple[int, int]]]:
    """Each kernel's parameters as ``(offset, size)`` in bytes within its parameter buffer, in order
    (by ordinal), from the EIATTR_KPARAM_INFO records of its ``.nv.info.<kernel>`` section."""
    kernels = {}
    for section in sections(cubin):
        if not section.name.startswith(_KERNEL_INFO):
            continue
        params = {}
        for attribute, payload in _info_records(section.body):
            if attribute == _EIATTR_KPARAM_INFO:
                _index, ordinal, offset, flags = _KPARAM_INFO.unpack(payload)
                params[ordinal] = (offset, (flags >> 18) & 0x3FFF)
        assert sorted(params) == list(range(len(params))), f"{section.name}: parameter ordinals {sorted(params)}"
        kernels[section.name[len(_KERNEL_INFO):]] = [params[ordinal] for ordinal in range(len(params))]
    return kernels


def function_resources(cubin: bytes) -> dict[str, tuple[int, int]]:
    """Each function's ``(registers a thread, stack frame bytes)``, by symbol, from the EIATTR_REGCOUNT and
    EIATTR_FRAME_SIZE records of the cubin's ``.nv.info`` section. A frame holds what did not fit the
    registers (spills) or a local array."""
    all_sections = sections(cubin)
    names = _symbol_names(all_sections)
    registers, frames = {}, {}
    for section in all_sections:
        if section.name != ".nv.info":
            continue
        for attribute, payload in _info_records(section.body):
            if attribute in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE):
                index, value = _FUNCTION_VALUE.unpack(payload)
                (registers if attribute == _EIATTR_REGCOUNT else frames)[names[index]] = value
    return {name: (count, frames.get(name, 0)) for name, count in registers.items()}
