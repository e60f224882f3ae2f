//! ns per ClientHello: reader + structured SNI on the recorded classic and post-quantum
//! hellos. `cargo bench --bench sni`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use waypoint::sni::{parse_client_hello, parse_sni, DEFAULT_MAX_HELLO_LEN};

const CLASSIC: &[u8] = include_bytes!("../testdata/rustls_classic.bin");
const PQ: &[u8] = include_bytes!("../testdata/rustls_pq.bin");
const OPENSSL: &[u8] = include_bytes!("../testdata/openssl.bin");

fn hello(c: &mut Criterion) {
    let mut group = c.benchmark_group("client_hello");
    for (name, wire) in [("classic", CLASSIC), ("pq", PQ), ("openssl", OPENSSL)] {
        group.throughput(Throughput::Elements(1));
        group.bench_function(name, |b| {
            b.iter(|| {
                let hello = parse_client_hello(black_box(wire), DEFAULT_MAX_HELLO_LEN);
                let target = hello.map(|h| parse_sni(h.sni(), "mesh.local"));
                black_box(target)
            })
        });
    }
    group.finish();
    c.bench_function("parse_sni", |b| {
        b.iter(|| parse_sni(black_box("8080.reviews.bookinfo.mesh.local"), "mesh.local"))
    });
}

criterion_group!(benches, hello);
criterion_main!(benches);
