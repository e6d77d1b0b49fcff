package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/kube"
)

// claimServer is an API server that knows only ResourceClaims, each one
// allocated gpu-0 of pool node-a, and answers at once: what is left to
// measure is the agent's side of reading them.
func claimServer(b *testing.B) *httptest.Server {
	const prefix = "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name, ok := strings.CutPrefix(r.URL.Path, prefix)
		if !ok || r.Method != http.MethodGet {
			http.NotFound(w, r)
			return
		}
		claim := resourceapi.ResourceClaim{
			TypeMeta:   metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaim"},
			ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name, UID: types.UID("uid-" + name)},
			Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
				Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-0"}},
			}}},
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(&claim)
	}))
	b.Cleanup(srv.Close)
	return srv
}

// instantClaims prepares every claim at once: the loop's share is not
// what this measures.
type instantClaims struct{}

func (instantClaims) PrepareClaims(_ context.Context, claims []dra.Claim) (map[types.UID]dra.Prepared, error) {
	out := make(map[types.UID]dra.Prepared, len(claims))
	for _, c := range claims {
		out[c.UID] = dra.Prepared{Devices: []dra.PreparedDevice{{Requests: []string{"gpu"}, Device: "gpu-0", CDIDevices: []string{"nvidia.com/gpu=0"}}}}
	}
	return out, nil
}

func (instantClaims) UnprepareClaims(_ context.Context, claims []dra.ClaimRef) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		out[c.UID] = nil
	}
	return out, nil
}

// BenchmarkPrepareClaims is one NodePrepareResources call of 100 claims, as
// the kubelet makes it on the driver's socket, with the claims read from
// the API server through the clients gpu-agent builds (kube.Connect, with
// their rate limits); "publishing busy" keeps the agent's other client
// (ResourceSlices, labels, Events) at its rate limit meanwhile. Issue 24:
// one call of 1000 claims ran into its deadline with nothing prepared.
//
//	cd test/bench && go test -run '^$' -bench PrepareClaims -benchtime 3x .
func BenchmarkPrepareClaims(b *testing.B) {
	b.Run("idle", func(b *testing.B) { benchPrepare(b, 100, false) })
	b.Run("publishing busy", func(b *testing.B) { benchPrepare(b, 100, true) })
}

func benchPrepare(b *testing.B, claims int, busy bool) {
	srv := claimServer(b)
	dir := b.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: bench, cluster: {server: %q}}]
users: [{name: bench, user: {}}]
contexts: [{name: bench, context: {cluster: bench, user: bench}}]
current-context: bench
`, srv.URL)), 0o600); err != nil {
		b.Fatal(err)
	}
	clients, _, err := kube.Connect(kubeconfig, "gpu-agent-bench")
	if err != nil {
		b.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "registry"), 0o755); err != nil {
		b.Fatal(err)
	}
	d := dra.New(dra.Options{NodeName: "node-a", Client: clients.Agent, ClaimReader: clients.Claims, Claims: instantClaims{},
		PluginDir: filepath.Join(dir, "plugin"), RegistryDir: filepath.Join(dir, "registry")})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if busy {
		// Requests as fast as the agent's client lets them through (the
		// server answers 404 at once).
		go func() {
			for ctx.Err() == nil {
				_, _ = clients.Agent.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
			}
		}()
	}
	if err := d.Start(ctx); err != nil {
		b.Fatal(err)
	}
	defer d.Stop()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "plugin", "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	kubelet := drapb.NewDRAPluginClient(conn)

	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		req := &drapb.NodePrepareResourcesRequest{}
		for c := range claims {
			// Names new to each call, as pods starting are.
			name := fmt.Sprintf("claim-%d-%d", i, c)
			req.Claims = append(req.Claims, &drapb.Claim{Namespace: "bench", Name: name, Uid: "uid-" + name})
		}
		resp, err := kubelet.NodePrepareResources(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		for uid, r := range resp.Claims {
			if r.GetError() != "" || len(r.GetDevices()) != 1 {
				b.Fatalf("claim %s: %+v", uid, r)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/call")
}
