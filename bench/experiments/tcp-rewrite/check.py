#!/usr/bin/env python3
"""Integrity check of the experiment (root, loopback): an echo pod and a sink pod, the
proxy in front of them, 2,000 verified 64 B echoes and a 200 MiB stream whose SHA-256
the sink sends back after the client's FIN. Exits non-zero on any mismatch or stall.
Prints the program's counters (rewritten, diverted, timestamp layout not handled)."""
import socket, struct, threading, hashlib, os, sys, time, subprocess
BODY = b"x" * 100 + b"echosvc" + b"y" * 1391
HELLO_E = b"\x16\x03\x01" + struct.pack("!H", len(BODY)) + BODY
HELLO_S = HELLO_E.replace(b"echosvc", b"sinksvc")
def serve(port, echo):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", port)); s.listen(64)
    def h(c):
        got = b""
        while len(got) < len(HELLO_E):
            got += c.recv(len(HELLO_E) - len(got))
        c.sendall(b"\x16")
        hsh = hashlib.sha256(); n = 0
        while True:
            d = c.recv(1 << 20)
            if not d: break
            if echo: c.sendall(d)
            else: hsh.update(d); n += len(d)
        if not echo: c.sendall(hsh.digest() + struct.pack("!Q", n))
        c.close()
    while True:
        c, _ = s.accept(); threading.Thread(target=h, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=(19001, True), daemon=True).start()
threading.Thread(target=serve, args=(19002, False), daemon=True).start()
time.sleep(0.2)
px = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy.py"), "127.0.0.1:19000", "127.0.0.1:19001", "127.0.0.1:19002"])
time.sleep(1.5)
try:
    # echo: hello + byte, answer + echo, then 1000 ping-pongs
    c = socket.create_connection(("127.0.0.1", 19000)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.settimeout(5)
    c.sendall(HELLO_E + b"\x42"); r = b""
    while len(r) < 2: r += c.recv(2 - len(r))
    assert r == b"\x16\x42", r
    t = time.perf_counter()
    for i in range(2000):
        m = os.urandom(64); c.sendall(m); r = b""
        while len(r) < 64: r += c.recv(64 - len(r))
        assert r == m
    print(f"echo ok, {((time.perf_counter()-t)/2000)*1e6:.1f} us per round trip (python both ends)")
    c.close()
    # sink: 200 MB with a checksum the sink sends back after our FIN
    c = socket.create_connection(("127.0.0.1", 19000)); c.settimeout(10)
    c.sendall(HELLO_S); assert c.recv(1) == b"\x16"
    h = hashlib.sha256(); blk = os.urandom(1 << 18); n = 0; t = time.perf_counter()
    while n < 200 << 20:
        c.sendall(blk); h.update(blk); n += len(blk)
    c.shutdown(socket.SHUT_WR)
    r = b""
    while len(r) < 40:
        d = c.recv(40 - len(r))
        if not d: break
        r += d
    dt = time.perf_counter() - t
    assert r[:32] == h.digest() and struct.unpack("!Q", r[32:])[0] == n, "digest mismatch"
    print(f"sink ok: {n>>20} MiB intact, {n*8/dt/1e9:.1f} Gbit/s (python client)")
finally:
    px.terminate(); px.wait()
    print(subprocess.run(["bpftool", "map", "dump", "pinned", "/sys/fs/bpf/tc/globals/rewrite_stats"], capture_output=True, text=True).stdout[-400:])
