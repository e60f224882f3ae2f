// SPDX-License-Identifier: GPL-2.0
//
// Experiment, not product code: splice two TCP connections by rewriting packet headers
// at lo's TC ingress. See README.md beside this file.
//
// The proxy (proxy.py) accepts the client's connection A, reads the ClientHello, dials
// the pod (connection B), and before it forwards the hello installs two entries:
//   client -> waypoint (A's tuple, as the client sends)  =>  waypoint -> pod (B's tuple)
//   pod -> waypoint    (B's tuple, as the pod sends)     =>  waypoint -> client (A's tuple)
// each with the offsets that move sequence and ack numbers from one connection's
// number space into the other's. From then on every packet of the client's goes
// straight to the pod's socket (and back) through one TCP traversal, with no socket of
// the proxy's in between.
//
// Loopback only: every address is local, so a rewritten packet is delivered by the
// local stack (TC_ACT_OK). Window scales are checked equal by the proxy. Timestamps are
// translated: each connection has its own random offset, and the receiver's PAWS check
// drops a segment whose TSval looks older than the last one it saw.
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

struct key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
};

struct rewrite {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u32 seq_add;      /* host order, added modulo 2^32 */
	__u32 ack_add;
	/* Pure ACKs from the pod up to this ack number (host order) acknowledge the hello
	 * the proxy's own socket sent: they go to that socket unchanged, so it never
	 * retransmits. 0: none (any more). */
	__u32 divert_until;
	/* TCP timestamps. ts_off: the TSval clock of the proxy socket whose identity the
	 * packet takes on, as an offset from CLOCK_MONOTONIC in ms (set by the proxy).
	 * ts_add: sender's clock -> that clock, learned from the first packet that carries
	 * a timestamp (flags & F_TS_LEARNED). ecr_sub: what the reverse direction learned,
	 * taken off TSecr so the receiver sees its own clock echoed. */
	__u32 ts_off;
	__u32 ts_add;
	__u32 ecr_sub;
	__u32 flags;
};

#define F_TS_LEARNED 1

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct key);
	__type(value, struct rewrite);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rewrites SEC(".maps");

enum { STAT_REWRITTEN, STAT_DIVERTED, STAT_TS_OTHER_LAYOUT, STAT_COUNT };

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_COUNT);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rewrite_stats SEC(".maps");

static __always_inline void count(__u32 stat)
{
	__u64 *v = bpf_map_lookup_elem(&rewrite_stats, &stat);
	if (v)
		*v += 1;
}

#define IP_OFF ETH_HLEN
#define IP_CSUM (IP_OFF + offsetof(struct iphdr, check))
#define IP_SADDR (IP_OFF + offsetof(struct iphdr, saddr))
#define IP_DADDR (IP_OFF + offsetof(struct iphdr, daddr))
#define TCP_OFF (IP_OFF + sizeof(struct iphdr))
#define TCP_SPORT (TCP_OFF + offsetof(struct tcphdr, source))
#define TCP_DPORT (TCP_OFF + offsetof(struct tcphdr, dest))
#define TCP_SEQ (TCP_OFF + offsetof(struct tcphdr, seq))
#define TCP_ACK (TCP_OFF + offsetof(struct tcphdr, ack_seq))
#define TCP_CSUM (TCP_OFF + offsetof(struct tcphdr, check))

static __always_inline void put32(struct __sk_buff *skb, __u32 off, __u32 csum_off,
				  __u32 from, __u32 to, __u64 flags)
{
	if (from == to)
		return;
	bpf_l4_csum_replace(skb, csum_off, from, to, flags | sizeof(to));
	bpf_skb_store_bytes(skb, off, &to, sizeof(to), 0);
}

/* Linux writes the timestamp option first, as NOP NOP TS (RFC 7323 appendix A). Other
 * layouts are counted and left alone (an experiment). */
static __always_inline void rewrite_ts(struct __sk_buff *skb, struct rewrite *r,
				       const struct rewrite *w)
{
	__u32 opt[3];

	if (bpf_skb_load_bytes(skb, TCP_OFF + sizeof(struct tcphdr), opt, sizeof(opt)) < 0)
		return;
	if (opt[0] != bpf_htonl(0x0101080a)) {
		count(STAT_TS_OTHER_LAYOUT);
		return;
	}
	__u32 tsval = bpf_ntohl(opt[1]), tsecr = bpf_ntohl(opt[2]);
	__u32 add = w->ts_add;
	if (!(w->flags & F_TS_LEARNED)) {
		__u32 now = (__u32)(bpf_ktime_get_ns() / 1000000) + w->ts_off;
		add = now - tsval;
		r->ts_add = add;
		r->flags |= F_TS_LEARNED;
		struct key back = {
			.saddr = w->daddr, .daddr = w->saddr,
			.sport = w->dport, .dport = w->sport,
		};
		struct rewrite *rev = bpf_map_lookup_elem(&rewrites, &back);
		if (rev)
			rev->ecr_sub = add;
	}
	__u32 off = TCP_OFF + sizeof(struct tcphdr) + 4;
	put32(skb, off, TCP_CSUM, opt[1], bpf_htonl(tsval + add), 0);
	if (tsecr)
		put32(skb, off + 4, TCP_CSUM, opt[2], bpf_htonl(tsecr - w->ecr_sub), 0);
}

SEC("tc")
int rewrite(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct tcphdr *tcp = (void *)(ip + 1);

	if ((void *)(tcp + 1) > end)
		return TC_ACT_OK;
	if (eth->h_proto != bpf_htons(ETH_P_IP) || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
		return TC_ACT_OK;

	struct key k = {
		.saddr = ip->saddr, .daddr = ip->daddr,
		.sport = tcp->source, .dport = tcp->dest,
	};
	struct rewrite *r = bpf_map_lookup_elem(&rewrites, &k);
	if (!r)
		return TC_ACT_OK;

	__u32 seq = tcp->seq, ack = tcp->ack_seq;
	__u32 payload = bpf_ntohs(ip->tot_len) - sizeof(struct iphdr) - tcp->doff * 4;
	__u32 until = r->divert_until;
	if (until && payload == 0 && !tcp->syn && !tcp->fin && !tcp->rst &&
	    (__s32)(bpf_ntohl(ack) - until) <= 0) {
		if (bpf_ntohl(ack) == until)
			r->divert_until = 0;
		count(STAT_DIVERTED);
		return TC_ACT_OK;
	}

	__u32 new_seq = bpf_htonl(bpf_ntohl(seq) + r->seq_add);
	__u32 new_ack = bpf_htonl(bpf_ntohl(ack) + r->ack_add);
	__u32 saddr = ip->saddr, daddr = ip->daddr;
	__u32 ports = *(__u32 *)&tcp->source;
	struct rewrite w = *r;
	__u32 new_ports = ((__u32)w.dport << 16) | w.sport; /* network layout: sport, dport */

	/* Addresses are in the pseudo header: both checksums. */
	if (saddr != w.saddr) {
		bpf_l3_csum_replace(skb, IP_CSUM, saddr, w.saddr, sizeof(__u32));
		put32(skb, IP_SADDR, TCP_CSUM, saddr, w.saddr, BPF_F_PSEUDO_HDR);
	}
	if (daddr != w.daddr) {
		bpf_l3_csum_replace(skb, IP_CSUM, daddr, w.daddr, sizeof(__u32));
		put32(skb, IP_DADDR, TCP_CSUM, daddr, w.daddr, BPF_F_PSEUDO_HDR);
	}
	put32(skb, TCP_SPORT, TCP_CSUM, ports, new_ports, 0);
	put32(skb, TCP_SEQ, TCP_CSUM, seq, new_seq, 0);
	put32(skb, TCP_ACK, TCP_CSUM, ack, new_ack, 0);
	rewrite_ts(skb, r, &w);
	count(STAT_REWRITTEN);
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
