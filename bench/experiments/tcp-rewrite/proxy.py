#!/usr/bin/env python3
"""Experiment, not product code: an SNI router whose established connections are spliced
by rewriting packet headers at lo's TC ingress (rewrite.bpf.c). See README.md.

Usage: proxy.py LISTEN ECHO SINK   (each HOST:PORT; loopback only)

Per connection: accept (A), read the ClientHello record and whatever followed it, pick
the pod by SNI, dial it (B), read both connections' sequence numbers (TCP_REPAIR), check
that the window scales line up, install the two rewrite entries, then forward the
hello on B. From then on the proxy's sockets see no packet: A stays frozen in repair
mode, B gets only the pod's acknowledgement of the hello (diverted to it) and is then
frozen too; both are closed silently when the proxy exits.
"""
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PIN_DIR = "/sys/fs/bpf/tc/globals"

TCP_REPAIR, TCP_REPAIR_QUEUE, TCP_QUEUE_SEQ = 19, 20, 21
TCP_RECV_QUEUE, TCP_SEND_QUEUE = 1, 2
TCP_REPAIR_OFF_NO_WP = -1
SIOCOUTQ = 0x5411

libc = ctypes.CDLL(None, use_errno=True)
SYS_BPF = 321
BPF_MAP_UPDATE_ELEM, BPF_OBJ_GET = 2, 7


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, 128)
    r = libc.syscall(SYS_BPF, cmd, buf, 128)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"bpf({cmd}): {os.strerror(e)}")
    return r


def obj_get(path):
    p = ctypes.create_string_buffer(path.encode())
    return bpf(BPF_OBJ_GET, struct.pack("QII", ctypes.addressof(p), 0, 0))


def map_update(fd, key, value):
    k = ctypes.create_string_buffer(key)
    v = ctypes.create_string_buffer(value)
    bpf(BPF_MAP_UPDATE_ELEM, struct.pack("IIQQQ", fd, 0, ctypes.addressof(k), ctypes.addressof(v), 0))


def tc(*args, check=True):
    return subprocess.run(["tc", *args], check=check, capture_output=True)


def build():
    """Compiles rewrite.bpf.c beside this file; returns the object's path."""
    import shutil
    import tempfile

    if not shutil.which("clang"):
        sys.exit("tc-rewrite: clang not found: apt-get install clang libbpf-dev")
    obj = os.path.join(tempfile.mkdtemp(prefix="tc-rewrite-"), "rewrite.bpf.o")
    src = os.path.join(HERE, "rewrite.bpf.c")
    arch = f"/usr/include/{os.uname().machine}-linux-gnu"
    subprocess.run(["clang", "-O2", "-g", "-target", "bpf", f"-I{arch}", "-c", src, "-o", obj], check=True)
    return obj


def attach(obj):
    tc("qdisc", "add", "dev", "lo", "clsact", check=False)
    tc("filter", "del", "dev", "lo", "ingress", "prio", "7", check=False)
    for m in ("rewrites", "rewrite_stats"):  # a previous run's maps, maybe of another layout
        try:
            os.unlink(f"{PIN_DIR}/{m}")
        except FileNotFoundError:
            pass
    tc("filter", "add", "dev", "lo", "ingress", "prio", "7", "handle", "7", "bpf", "da", "obj", obj, "sec", "tc")


def detach():
    tc("filter", "del", "dev", "lo", "ingress", "prio", "7", check=False)


def seqs(s):
    """(write_seq, rcv_nxt) of a socket, leaving it in repair mode."""
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)
    snd = struct.unpack("I", s.getsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ, 4))[0]
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE)
    rcv = struct.unpack("I", s.getsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ, 4))[0]
    return snd, rcv


def wscales(s):
    """(snd_wscale, rcv_wscale) from TCP_INFO."""
    b = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[6]
    return b & 0xF, b >> 4


def tuple_bytes(src, dst):
    return socket.inet_aton(src[0]), socket.inet_aton(dst[0]), struct.pack("!H", src[1]), struct.pack("!H", dst[1])


def key(src, dst):
    sa, da, sp, dp = tuple_bytes(src, dst)
    return sa + da + sp + dp


TCP_TIMESTAMP = 24


def ts_off(s):
    """The socket's TSval clock as an offset from CLOCK_MONOTONIC in ms."""
    ts = struct.unpack("I", s.getsockopt(socket.IPPROTO_TCP, TCP_TIMESTAMP, 4))[0]
    return ts - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000


def value(src, dst, seq_add, ack_add, divert_until, ts_off):
    m = 2**32
    return key(src, dst) + struct.pack(
        "<IIIIIII", seq_add % m, ack_add % m, divert_until % m, ts_off % m, 0, 0, 0
    )


def read_hello(a):
    data = b""
    while len(data) < 5 or len(data) < 5 + struct.unpack("!H", data[3:5])[0]:
        chunk = a.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the hello was whole")
        data += chunk
    # Whatever the client sent with the hello (the benchmark's probe sends one byte).
    while True:
        try:
            chunk = a.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


held = []
lock = threading.Lock()
stats = {"spliced": 0, "refused": 0}


def handle(a, map_fd, echo, sink):
    try:
        data = read_hello(a)
        pod = echo if b"echosvc" in data else sink
        b = socket.create_connection(pod)
        b.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if wscales(a)[0] != wscales(b)[1] or wscales(b)[0] != wscales(a)[1]:
            print(f"window scales differ: A {wscales(a)} B {wscales(b)}; refused", file=sys.stderr)
            stats["refused"] += 1
            a.close(), b.close()
            return
        a_snd, a_rcv = seqs(a)  # A stays frozen from here on
        b_snd, b_rcv = seqs(b)
        b.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP)
        hello_end = b_snd + len(data)
        d1 = hello_end - a_rcv  # client's sequence space -> B's
        d2 = b_rcv - a_snd      # A's sequence space (what the client acks) -> the pod's
        cli, wp_a = a.getpeername(), a.getsockname()
        wp_b, pod_addr = b.getsockname(), b.getpeername()
        map_update(map_fd, key(cli, wp_a), value(wp_b, pod_addr, d1, d2, 0, ts_off(b)))
        map_update(map_fd, key(pod_addr, wp_b), value(wp_a, cli, -d2, -d1, hello_end, ts_off(a)))
        b.sendall(data)
        # Freeze B once the pod has acknowledged the hello (diverted to it).
        deadline = time.monotonic() + 2
        buf = ctypes.c_int(0)
        while time.monotonic() < deadline:
            fcntl.ioctl(b.fileno(), SIOCOUTQ, buf)
            if buf.value == 0:
                break
            time.sleep(0.0005)
        b.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
        with lock:
            held.append((a, b))
            stats["spliced"] += 1
    except Exception as e:  # an experiment: report and drop the connection
        print(f"connection failed: {e!r}", file=sys.stderr)
        a.close()


def main():
    listen, echo, sink = (
        (h, int(p)) for h, p in (x.rsplit(":", 1) for x in sys.argv[1:4])
    )
    attach(build())
    map_fd = obj_get(f"{PIN_DIR}/rewrites")

    def stop(*_):
        detach()
        print(f"stats {stats}", file=sys.stderr)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(listen)
    srv.listen(1024)
    while True:
        a, _ = srv.accept()
        a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(a, map_fd, echo, sink), daemon=True).start()


if __name__ == "__main__":
    main()
