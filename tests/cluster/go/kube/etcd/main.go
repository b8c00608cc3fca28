// Command etcd runs a single-member etcd for the test control plane.
//
// It is built from go.etcd.io/etcd/server/v3/embed at the version the chosen
// Kubernetes release pins, because no etcd release binary can be downloaded
// here and distribution packages are too old for current API servers.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(raw string) url.URL {
	u, err := url.Parse(raw)
	if err != nil {
		log.Fatalf("bad URL %q: %v", raw, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "", "data directory (required)")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL (also advertised)")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL (also advertised)")
	logLevel := flag.String("log-level", "warn", "debug, info, warn or error")
	noFsync := flag.Bool("unsafe-no-fsync", true, "skip fsync: fast, and fine for throwaway test data")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}

	cfg := embed.NewConfig()
	cfg.Name = "packtrain-test"
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{mustURL(*clientURL)}
	cfg.AdvertiseClientUrls = cfg.ListenClientUrls
	cfg.ListenPeerUrls = []url.URL{mustURL(*peerURL)}
	cfg.AdvertisePeerUrls = cfg.ListenPeerUrls
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = *logLevel
	cfg.UnsafeNoFsync = *noFsync

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("starting etcd: %v", err)
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
		log.Printf("etcd ready on %s", *clientURL)
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		log.Fatal("etcd did not become ready within 60s")
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case s := <-sig:
		log.Printf("stopping on %v", s)
	case err := <-e.Err():
		log.Fatalf("etcd failed: %v", err)
	}
}
