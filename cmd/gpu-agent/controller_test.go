package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/leaderelection"
)

// TestRunElected: the candidate takes the Lease, works while holding it,
// and releases it when stopped; a Lease another replica holds keeps the
// work from starting.
func TestRunElected(t *testing.T) {
	kube := fake.NewClientset()
	// A short retry period: replica-b's next try comes soon after
	// replica-a releases the Lease. The lease duration is long enough
	// that replica-b could not take a held Lease within the test.
	timing := electionTiming{lease: time.Minute, renew: 30 * time.Second, retry: 50 * time.Millisecond}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	working := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- runElected(ctx, kube, "gpu-agent", "ctl", "replica-a", timing,
			leaderelection.NewLeaderHealthzAdaptor(time.Minute), log, func(ctx context.Context) error {
				working <- struct{}{}
				<-ctx.Done()
				return nil
			})
	}()
	testwait.Receive(t, "work started", working, func(struct{}) bool { return true })
	lease, err := kube.CoordinationV1().Leases("gpu-agent").Get(context.Background(), "ctl", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := lease.Spec.HolderIdentity; h == nil || *h != "replica-a" {
		t.Fatalf("lease holder %v, want replica-a", h)
	}

	// A second replica stands by: the Lease is held and fresh.
	ctx2, cancel2 := context.WithCancel(context.Background())
	started := make(chan struct{}, 1)
	done2 := make(chan error, 1)
	go func() {
		done2 <- runElected(ctx2, kube, "gpu-agent", "ctl", "replica-b", timing,
			leaderelection.NewLeaderHealthzAdaptor(time.Minute), log, func(context.Context) error {
				started <- struct{}{}
				return nil
			})
	}()

	if len(started) > 0 {
		t.Fatal("replica-b works while replica-a holds the Lease")
	}
	cancel()
	if err := testwait.Receive(t, "replica-a stopped", done, func(error) bool { return true }); err != nil {
		t.Errorf("stopped replica: %v", err)
	}
	// Released on stop: replica-b takes over at its next try, without
	// waiting out the lease duration.
	testwait.Receive(t, "replica-b took over", started, func(struct{}) bool { return true })
	// Its work ended while it still held the Lease and its context was
	// live: it reports the Lease lost, so the process restarts.
	err = testwait.Receive(t, "replica-b stopped", done2, func(error) bool { return true })
	cancel2()
	if !errors.Is(err, errLostLease) {
		t.Errorf("replica-b: %v, want %v", err, errLostLease)
	}
}

func TestControllerFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"controller", "--namespace", ""}, "--namespace"},
		{[]string{"controller", "--namespace", "x", "--workers", "0"}, "--workers"},
		{[]string{"controller", "--namespace", "x", "--lease-duration", "5s"}, "lease > renew"},
		{[]string{"controller", "--namespace", "x", "extra"}, "unexpected arguments"},
	} {
		var stderr bytes.Buffer
		t.Setenv("POD_NAMESPACE", "")
		if code := runMain(context.Background(), tc.args, io.Discard, &stderr); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, %q; want 2 naming %s", tc.args, code, stderr.String(), tc.want)
		}
	}
}
