//! Struct member offsets from the running kernel's BTF (`/sys/kernel/btf/vmlinux`).
//!
//! The verdict program reads two kernel fields that no BPF context exposes (a segment's
//! sequence number, a socket's `copied_seq`); their offsets differ between kernel builds,
//! so the loader looks them up here and hands them to the program as constants. Only
//! what that needs is parsed: the type section, walked to find one struct's members.
//! Format: <https://docs.kernel.org/bpf/btf.html>.

use std::path::Path;

/// Where the running kernel publishes its BTF.
pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// Errors reading member offsets from BTF.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("malformed BTF: {0}")]
    Malformed(&'static str),
    #[error("no struct {0} in the kernel's BTF")]
    NoStruct(String),
    #[error("struct {0} has no member {1}")]
    NoMember(String, String),
    #[error("{0}.{1} is a bitfield")]
    Bitfield(String, String),
}

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

/// One type's record: its name, kind, and for structs and unions the members as
/// (name offset, type id, offset word).
struct Type {
    name: u32,
    kind: u32,
    kflag: bool,
    members: Vec<(u32, u32, u32)>,
}

/// The parsed type section of one BTF blob.
pub struct Btf {
    /// Indexed by type id; id 0 (void) is a placeholder.
    types: Vec<Type>,
    strings: Vec<u8>,
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, Error> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or(Error::Malformed("truncated"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, Error> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(Error::Malformed("truncated"))
}

impl Btf {
    /// Reads the BTF of the running kernel.
    pub fn vmlinux() -> Result<Btf, Error> {
        Btf::from_file(Path::new(VMLINUX))
    }

    pub fn from_file(path: &Path) -> Result<Btf, Error> {
        let data = std::fs::read(path).map_err(|source| Error::Read {
            path: path.display().to_string(),
            source,
        })?;
        Btf::parse(&data)
    }

    /// Parses a little-endian BTF blob (the byte order of every kernel we load into).
    pub fn parse(data: &[u8]) -> Result<Btf, Error> {
        if u16_at(data, 0)? != MAGIC {
            return Err(Error::Malformed("bad magic (or a big-endian kernel)"));
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let section = |off: usize, len: usize| -> Result<&[u8], Error> {
            let start = hdr_len
                .checked_add(u32_at(data, off)? as usize)
                .ok_or(Error::Malformed("section offset"))?;
            let len = u32_at(data, len)? as usize;
            data.get(start..start.saturating_add(len))
                .ok_or(Error::Malformed("section out of bounds"))
        };
        let types = section(8, 12)?;
        let strings = section(16, 20)?.to_vec();

        let mut out = vec![Type {
            name: 0,
            kind: 0,
            kflag: false,
            members: Vec::new(),
        }];
        let mut at = 0;
        while at < types.len() {
            let name = u32_at(types, at)?;
            let info = u32_at(types, at + 4)?;
            at += 12;
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let kflag = info >> 31 == 1;
            let mut members = Vec::new();
            // Bytes that follow the common header, per kind.
            let extra = match kind {
                1 | 14 | 17 => 4, // int, var, decl_tag
                3 => 12,          // array
                KIND_STRUCT | KIND_UNION => {
                    for i in 0..vlen {
                        let m = at + i * 12;
                        members.push((
                            u32_at(types, m)?,
                            u32_at(types, m + 4)?,
                            u32_at(types, m + 8)?,
                        ));
                    }
                    vlen * 12
                }
                6 | 13 => vlen * 8,        // enum, func_proto
                15 | 19 => vlen * 12,      // datasec, enum64
                2 | 7..=12 | 16 | 18 => 0, // ptr, fwd, typedef, modifiers, func, float, type_tag
                _ => return Err(Error::Malformed("unknown type kind")),
            };
            at += extra;
            out.push(Type {
                name,
                kind,
                kflag,
                members,
            });
        }
        Ok(Btf {
            types: out,
            strings,
        })
    }

    fn name(&self, off: u32) -> &[u8] {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// Byte offset of `member` in `struct name`, looking into anonymous struct and union
    /// members (where the kernel puts many fields).
    pub fn member_offset(&self, name: &str, member: &str) -> Result<u32, Error> {
        let id = self
            .types
            .iter()
            .position(|t| t.kind == KIND_STRUCT && self.name(t.name) == name.as_bytes())
            .ok_or_else(|| Error::NoStruct(name.to_owned()))?;
        let (bits, bitfield) = self
            .find(id, member.as_bytes(), 0, 0)?
            .ok_or_else(|| Error::NoMember(name.to_owned(), member.to_owned()))?;
        if bitfield || bits % 8 != 0 {
            return Err(Error::Bitfield(name.to_owned(), member.to_owned()));
        }
        Ok(bits / 8)
    }

    /// Bit offset of `member` within type `id` (plus `base`), searching anonymous struct
    /// and union members, and whether it is a bitfield.
    fn find(
        &self,
        id: usize,
        member: &[u8],
        base: u32,
        depth: u8,
    ) -> Result<Option<(u32, bool)>, Error> {
        // Anonymous members nest a few levels at most; a cycle would be malformed BTF.
        if depth > 8 {
            return Err(Error::Malformed("anonymous members nest too deep"));
        }
        let Some(t) = self.types.get(id) else {
            return Err(Error::Malformed("type id out of range"));
        };
        for &(name, ty, offset) in &t.members {
            // With kflag, the offset word also carries the bitfield size in its top byte.
            let (bits, bitfield) = if t.kflag {
                (offset & 0x00ff_ffff, offset >> 24 != 0)
            } else {
                (offset, false)
            };
            if name == 0 {
                // The kernel's anonymous members are structs and unions, referenced
                // directly; anything else has no members and is skipped by the loop.
                if let Some(found) = self.find(ty as usize, member, base + bits, depth + 1)? {
                    return Ok(Some(found));
                }
            } else if self.name(name) == member {
                return Ok(Some((base + bits, bitfield)));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A tiny BTF blob: `struct outer { int a; union { int b; }; }` with `b` at byte 8.
    fn blob() -> Vec<u8> {
        let strings = b"\0outer\0a\0b\0int\0".to_vec();
        let mut types = Vec::new();
        let mut put = |w: &[u32]| {
            w.iter()
                .for_each(|v| types.extend_from_slice(&v.to_le_bytes()))
        };
        // [1] int "int", size 4
        put(&[13, 1 << 24, 4, 32]);
        // [2] struct "outer", 2 members, size 12
        put(&[1, (KIND_STRUCT << 24) | 2, 12]);
        put(&[7, 1, 0]); // a: int at bit 0
        put(&[0, 3, 64]); // anonymous union at bit 64
                          // [3] union (anonymous), 1 member
        put(&[0, (KIND_UNION << 24) | 1, 4]);
        put(&[9, 1, 0]); // b: int
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&[1, 0]); // version, flags
        for v in [
            24u32,
            0,
            types.len() as u32,
            types.len() as u32,
            strings.len() as u32,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&types);
        out.extend_from_slice(&strings);
        out
    }

    #[test]
    fn finds_direct_and_anonymous_members() {
        let btf = Btf::parse(&blob()).unwrap();
        assert_eq!(btf.member_offset("outer", "a").unwrap(), 0);
        assert_eq!(btf.member_offset("outer", "b").unwrap(), 8);
        assert!(matches!(
            btf.member_offset("outer", "c"),
            Err(Error::NoMember(..))
        ));
        assert!(matches!(
            btf.member_offset("inner", "a"),
            Err(Error::NoStruct(_))
        ));
    }

    #[test]
    fn rejects_truncated_and_foreign_blobs() {
        let b = blob();
        assert!(matches!(Btf::parse(&b[..30]), Err(Error::Malformed(_))));
        assert!(matches!(
            Btf::parse(b"\x9f\xeb\x01\x00"),
            Err(Error::Malformed(_))
        ));
        let mut bad = b.clone();
        bad[0] = 0;
        assert!(matches!(Btf::parse(&bad), Err(Error::Malformed(_))));
    }

    /// The running kernel's BTF (CI runs on a BTF kernel): the fields the verdict reads.
    #[test]
    fn vmlinux_has_the_fields_the_verdict_reads() {
        let btf = Btf::vmlinux().unwrap();
        let cb = btf.member_offset("sk_buff", "cb").unwrap();
        let seq = btf.member_offset("tcp_skb_cb", "seq").unwrap();
        let sk = btf.member_offset("sk_buff", "sk").unwrap();
        let copied = btf.member_offset("tcp_sock", "copied_seq").unwrap();
        eprintln!(
            "sk_buff.cb {cb}, tcp_skb_cb.seq {seq}, sk_buff.sk {sk}, tcp_sock.copied_seq {copied}"
        );
        assert!(cb > 0 && sk > 0 && copied > 0);
    }
}
