//! The clsact qdisc that the rewrite program needs where it is attached through netlink.
//!
//! Kernels before 6.6 have no TCX: aya attaches a classifier as a netlink filter, which
//! needs the interface's clsact qdisc, and a stock node has none ("Parent Qdisc doesn't
//! exists"). The daemon adds one where none is and removes, on exit, the ones it added,
//! unless another program's filter sits on one by then: removing a qdisc removes its
//! filters, and those would not be the daemon's to remove.

use std::io;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::{
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    RouteNetlinkMessage,
};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

/// Errors of managing a clsact qdisc.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The netlink socket could not be opened, or a request not sent or answered.
    #[error("netlink: {0}")]
    Io(#[source] io::Error),
    /// The kernel refused the request.
    #[error("the kernel refused: {0}")]
    Refused(#[source] io::Error),
    /// An answer that is not netlink.
    #[error("an answer that could not be read: {0}")]
    Decode(String),
}

/// The clsact qdisc's handle (`ffff:0`).
const HANDLE: TcHandle = TcHandle {
    major: 0xffff,
    minor: 0,
};

/// Adds a clsact qdisc to interface `index`. `Ok(true)` when it added one, `Ok(false)`
/// when the interface has one already (the daemon's from an earlier run, or anyone's).
pub fn add(index: u32) -> Result<bool, Error> {
    let mut msg = qdisc(index);
    msg.attributes.push(TcAttribute::Kind("clsact".into()));
    match request(
        RouteNetlinkMessage::NewQueueDiscipline(msg),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Ok(_) => Ok(true),
        Err(Error::Refused(e)) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes interface `index`'s clsact qdisc, with any filter on it.
pub fn remove(index: u32) -> Result<(), Error> {
    request(RouteNetlinkMessage::DelQueueDiscipline(qdisc(index)), 0).map(drop)
}

/// The filters on interface `index`'s clsact qdisc, ingress and egress.
pub fn filters(index: u32) -> Result<usize, Error> {
    let mut n = 0;
    for minor in [TcHandle::MIN_INGRESS, TcHandle::MIN_EGRESS] {
        let mut msg = TcMessage::with_index(index as i32);
        msg.header.parent = TcHandle {
            major: 0xffff,
            minor,
        };
        n += request(RouteNetlinkMessage::GetTrafficFilter(msg), NLM_F_DUMP)?
            .iter()
            .filter(|m| matches!(m, RouteNetlinkMessage::NewTrafficFilter(_)))
            .count();
    }
    Ok(n)
}

/// A BPF filter on an interface's clsact ingress, as a dump lists it.
#[derive(Debug, Clone)]
pub struct BpfFilter {
    /// The dump's message, whose header (interface, parent, priority and protocol,
    /// handle) names the filter in a request to remove it.
    header: TcMessage,
    /// The program's name (`TCA_BPF_NAME`), if the kernel gave one.
    pub name: Option<String>,
    /// The program's id (`TCA_BPF_ID`), if the kernel gave one.
    pub prog_id: Option<u32>,
}

/// The BPF filters on interface `index`'s clsact ingress (none when it has no clsact
/// qdisc).
pub fn ingress_bpf_filters(index: u32) -> Result<Vec<BpfFilter>, Error> {
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.parent = TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_INGRESS,
    };
    let answers = match request(RouteNetlinkMessage::GetTrafficFilter(msg), NLM_F_DUMP) {
        Ok(a) => a,
        // No clsact qdisc: no filter.
        Err(Error::Refused(e)) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    let mut filters = Vec::new();
    for answer in answers {
        let RouteNetlinkMessage::NewTrafficFilter(m) = answer else {
            continue;
        };
        // A priority's chain head has no handle; only filters have one.
        let bpf = m
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(k) if k == "bpf"));
        if !bpf || m.header.handle == TcHandle::UNSPEC {
            continue;
        }
        let (mut name, mut prog_id) = (None, None);
        for a in &m.attributes {
            let TcAttribute::Options(options) = a else {
                continue;
            };
            for o in options {
                match o {
                    TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = Some(n.clone()),
                    TcOption::Bpf(TcFilterBpfOption::ProgId(i)) => prog_id = Some(*i),
                    _ => {}
                }
            }
        }
        filters.push(BpfFilter {
            header: TcMessage::from_parts(m.header, vec![TcAttribute::Kind("bpf".into())]),
            name,
            prog_id,
        });
    }
    Ok(filters)
}

/// Removes one filter that [`ingress_bpf_filters`] listed.
pub fn remove_filter(filter: &BpfFilter) -> Result<(), Error> {
    request(
        RouteNetlinkMessage::DelTrafficFilter(filter.header.clone()),
        0,
    )
    .map(drop)
}

/// The clsact qdisc of interface `index`, as a request names it.
fn qdisc(index: u32) -> TcMessage {
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.handle = HANDLE;
    msg.header.parent = TcHandle::CLSACT;
    msg
}

/// Sends one request and reads its answers: a dump's messages until its end, or the
/// acknowledgement of anything else.
fn request(msg: RouteNetlinkMessage, flags: u16) -> Result<Vec<RouteNetlinkMessage>, Error> {
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(Error::Io)?;
    socket.bind_auto().map_err(Error::Io)?;
    socket.connect(&SocketAddr::new(0, 0)).map_err(Error::Io)?;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
    header.sequence_number = 1;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
    packet.finalize();
    let mut out = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut out);
    socket.send(&out, 0).map_err(Error::Io)?;

    let mut answers = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0).map_err(Error::Io)?;
        let mut at = 0;
        while at < size {
            let answer = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..size])
                .map_err(|e| Error::Decode(e.to_string()))?;
            let len = answer.header.length as usize;
            match answer.payload {
                NetlinkPayload::Done(_) => return Ok(answers),
                NetlinkPayload::Error(e) => match e.code {
                    // The acknowledgement.
                    None => return Ok(answers),
                    Some(_) => return Err(Error::Refused(e.to_io())),
                },
                NetlinkPayload::InnerMessage(m) => answers.push(m),
                _ => {}
            }
            if len == 0 {
                return Err(Error::Decode("a message of length 0".into()));
            }
            at += (len + 3) & !3;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// An interface that is not there (gone between the listing and the attachment): adding
    /// or removing its qdisc is the kernel's refusal, named, never a panic; listing its
    /// filters finds none.
    #[test]
    fn a_missing_interface_is_refused_by_name() {
        let missing = u32::MAX - 7;
        for (what, result) in [("add", add(missing).map(drop)), ("remove", remove(missing))] {
            match result {
                Err(Error::Refused(e)) => {
                    assert!(
                        matches!(e.raw_os_error(), Some(libc::ENODEV | libc::EINVAL)),
                        "{what}: {e}"
                    );
                }
                other => panic!("{what}: not a refusal: {other:?}"),
            }
        }
        // A dump names no filter there, rather than failing.
        match filters(missing) {
            Ok(0) | Err(Error::Refused(_)) => {}
            other => panic!("filters: {other:?}"),
        }
    }
}
