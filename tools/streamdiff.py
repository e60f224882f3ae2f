#!/usr/bin/env python3
"""Compares the byte streams on both sides of a waypoint, from packet captures.

Used to find out what happened to a corrupted transfer (issue #2): capture the tunnel
side and the pod side in the waypoint's namespace, e.g.

  ip netns exec wp-b1 tcpdump -Z root -i eth0 -s 0 -B 131072 -w eth0.pcap 'tcp port 15443'
  ip netns exec wp-b1 tcpdump -Z root -i cni0 -s 0 -B 131072 -w cni0.pcap 'tcp port 15008'

then `streamdiff.py eth0.pcap 15443 cni0.pcap 15008` rebuilds the last connection of each
capture by sequence number and reports, per direction, the first byte where what the
waypoint sent differs from what it received, and where the sent bytes really come from
(a negative delta is a duplicate, a positive one a loss). `--acks LO HI` lists the
segments, ACKs and (D-)SACK blocks of the tunnel side between stream offsets LO and HI.
Plain pcap (tcpdump -w), Ethernet + IPv4 only. Standard library only.
"""
import argparse
import struct


def packets(path):
    with open(path, "rb") as f:
        magic = struct.unpack("<I", f.read(24)[:4])[0]
        if magic not in (0xA1B2C3D4, 0xA1B23C4D):
            raise SystemExit(f"{path}: not a little-endian pcap file")
        while True:
            h = f.read(16)
            if len(h) < 16:
                return
            incl = struct.unpack("<IIII", h)[2]
            yield f.read(incl)


def tcp_segments(path):
    """(src port, dst port, seq, ack, flags, options, payload) of each IPv4 TCP packet."""
    for d in packets(path):
        if len(d) < 34 or struct.unpack(">H", d[12:14])[0] != 0x0800:
            continue
        ip = d[14:]
        ihl = (ip[0] & 15) * 4
        if ip[9] != 6:
            continue
        tcp = ip[ihl : struct.unpack(">H", ip[2:4])[0]]
        sp, dp, seq, ack = struct.unpack(">HHII", tcp[:12])
        off = (tcp[12] >> 4) * 4
        yield sp, dp, seq, ack, tcp[13], tcp[20:off], tcp[off:]


class Stream:
    def __init__(self, isn):
        self.isn, self.data, self.spans = isn, bytearray(), []

    def add(self, seq, payload):
        rel = (seq - self.isn - 1) & 0xFFFFFFFF
        if not payload or rel > 1 << 31:
            return
        end = rel + len(payload)
        if len(self.data) < end:
            self.data.extend(bytes(end - len(self.data)))
        self.data[rel:end] = payload
        self.spans.append((rel, end))

    def holes(self):
        n, reach = 0, 0
        for a, b in sorted(self.spans):
            n += a > reach
            reach = max(reach, b)
        return n


def last_connection(path, port):
    """The client->server and server->client streams of the last connection to `port`."""
    up = down = None
    client = None
    for sp, dp, seq, _ack, flags, _opts, payload in tcp_segments(path):
        if dp == port and flags & 2:
            client, up, down = sp, Stream(seq), None
        elif sp == port and dp == client and flags & 2:
            down = Stream(seq)
        elif dp == port and sp == client and up:
            up.add(seq, payload)
        elif sp == port and dp == client and down:
            down.add(seq, payload)
    if not (up and down):
        raise SystemExit(f"{path}: no complete connection to port {port}")
    return up, down


def compare(name, received, sent):
    a, b = received.data, sent.data
    n = min(len(a), len(b))
    first = next((i for i in range(0, n, 4096) if a[i : min(i + 4096, n)] != b[i : min(i + 4096, n)]), None)
    if first is None:
        print(f"{name}: {n} bytes compared, identical (holes: {received.holes()} / {sent.holes()})")
        return
    while first < n and a[first] == b[first]:
        first += 1
    probe = bytes(b[first : first + 64])
    origin = a.find(probe, max(0, first - (64 << 20)))
    delta = origin - first if origin >= 0 else None
    print(f"{name}: first difference at offset {first}; the bytes sent there were received at "
          f"{origin} (delta {delta}); holes: {received.holes()} / {sent.holes()}")


def acks(path, port, lo, hi):
    client = isn = None
    for sp, dp, seq, ack, flags, opts, payload in tcp_segments(path):
        if dp == port and flags & 2:
            client, isn = sp, seq
        if isn is None:
            continue
        if dp == port and sp == client and payload:
            rel = (seq - isn - 1) & 0xFFFFFFFF
            if lo <= rel <= hi:
                print(f"-> seq {rel} len {len(payload)}")
        elif sp == port and dp == client:
            a = (ack - isn - 1) & 0xFFFFFFFF
            sacks, i = [], 0
            while i < len(opts) and opts[i] != 0:
                if opts[i] == 1:
                    i += 1
                    continue
                if opts[i] == 5:
                    for j in range(i + 2, i + opts[i + 1], 8):
                        s, e = struct.unpack(">II", opts[j : j + 8])
                        sacks.append(((s - isn - 1) & 0xFFFFFFFF, (e - isn - 1) & 0xFFFFFFFF))
                i += max(opts[i + 1], 2)
            if lo <= a <= hi:
                print(f"<- ack {a} sack {sacks}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tunnel_pcap")
    p.add_argument("tunnel_port", type=int)
    p.add_argument("pod_pcap", nargs="?")
    p.add_argument("pod_port", type=int, nargs="?")
    p.add_argument("--acks", nargs=2, type=int, metavar=("LO", "HI"))
    args = p.parse_args()
    if args.acks:
        acks(args.tunnel_pcap, args.tunnel_port, *args.acks)
        return
    c2w, w2c = last_connection(args.tunnel_pcap, args.tunnel_port)
    w2p, p2w = last_connection(args.pod_pcap, args.pod_port)
    compare("client -> pod", c2w, w2p)
    compare("pod -> client", p2w, w2c)


if __name__ == "__main__":
    main()
