package controller

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The node side publishes its channels with allowMultipleAllocations, so
// the scheduler allocates every workload claim on a node a share of
// channel-0, each with a shareID. The API server keys a claim's
// status.devices by driver, pool, device and shareID: DaemonReady goes on
// the entry of each share of the claim, and a share's True condition is
// not taken for another's.
func TestDaemonReadyPerShare(t *testing.T) {
	const s1, s2 = "3c9a1e50-7b2d-4f6a-9e81-0d4c2b7a5f11", "3c9a1e50-7b2d-4f6a-9e81-0d4c2b7a5f22"
	type result struct{ request, share string }
	cases := []struct {
		name    string
		results []result
		// before are the claim's status.devices entries (device/share)
		// already holding DaemonReady True.
		before []string
		want   []string
	}{
		{"a device allocated whole", []result{{"channel", ""}}, nil, []string{"channel-0/"}},
		{"one share", []result{{"channel", s1}}, nil, []string{"channel-0/" + s1}},
		{"two requests, two shares of one device", []result{{"channel", s1}, {"more", s2}}, nil,
			[]string{"channel-0/" + s1, "channel-0/" + s2}},
		{"one share ready, the other not yet", []result{{"channel", s1}, {"more", s2}}, []string{"channel-0/" + s1},
			[]string{"channel-0/" + s1, "channel-0/" + s2}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cd := domain("train", 1, "")
			cl := claim(cd, "w1", "n1", true)
			base := cl.Status.Allocation.Devices.Results[0]
			cl.Status.Allocation.Devices.Results = nil
			for _, r := range c.results {
				next := base
				next.Request = r.request
				if r.share != "" {
					id := types.UID(r.share)
					next.ShareID = &id
				}
				cl.Status.Allocation.Devices.Results = append(cl.Status.Allocation.Devices.Results, next)
			}
			for _, b := range c.before {
				device, share, _ := strings.Cut(b, "/")
				cl.Status.Devices = append(cl.Status.Devices, resourcev1.AllocatedDeviceStatus{Driver: DriverName, Pool: "n1", Device: device, ShareID: &share,
					Conditions: []metav1.Condition{{Type: ConditionDaemonReady, Status: metav1.ConditionTrue, Reason: "DaemonReady", LastTransitionTime: metav1.Now()}}})
			}
			h := newHarness(t, node("n1", "cu.1"), cl)
			h.create(cd)
			h.waitStatus(cd, "n1 placed", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 1 })
			h.report(cd, "n1", cdv1.StatusReady)
			var got []string
			testwait.For(t, fmt.Sprintf("DaemonReady on %v", c.want), func() bool {
				got = readyShares(h, "w1")
				return slices.Equal(got, c.want)
			})
		})
	}
}

// readyShares are the claim's status.devices entries with DaemonReady
// True, as device/share, sorted.
func readyShares(h *harness, name string) []string {
	c, err := h.kube.ResourceV1().ResourceClaims("team").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	var out []string
	for _, d := range c.Status.Devices {
		if d.Driver != DriverName || d.Pool != "n1" {
			continue
		}
		share := ""
		if d.ShareID != nil {
			share = *d.ShareID
		}
		for _, cond := range d.Conditions {
			if cond.Type == ConditionDaemonReady && cond.Status == metav1.ConditionTrue {
				out = append(out, d.Device+"/"+share)
			}
		}
	}
	slices.Sort(out)
	return out
}
