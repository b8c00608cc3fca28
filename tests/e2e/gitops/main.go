// Command gitops-sync runs one Argo CD sync of a folder of manifests into a namespace.
//
// It drives the sync engine Argo CD itself runs (github.com/argoproj/gitops-engine, the version
// Argo CD v3.2 pins), the way the engine's own agent example does: a cluster cache of the
// namespace, the folder's manifests as the target state, and engine.Sync, which honours each
// manifest's argocd.argoproj.io/sync-options annotation (Replace=true, Force=true, ...) and prunes
// managed objects that left the folder. Objects are tracked as Argo CD tracks them with the
// argocd.argoproj.io/tracking-id annotation ("<app>:<group>/<kind>:<namespace>/<name>").
//
// Usage: gitops-sync --kubeconfig FILE --namespace NS --app NAME [--prune] DIR
//
// Stdout is one JSON object: {"resources": [{"group", "kind", "namespace", "name", "status",
// "message", "syncPhase"}]}. Exit status: 0 when every resource synced or was pruned, 1 when the
// sync failed (the failing resource's message says why), 2 for bad usage.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/argoproj/gitops-engine/pkg/cache"
	"github.com/argoproj/gitops-engine/pkg/engine"
	"github.com/argoproj/gitops-engine/pkg/sync"
	"github.com/argoproj/gitops-engine/pkg/sync/common"
	"github.com/argoproj/gitops-engine/pkg/utils/kube"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2/textlogger"
)

const trackingAnnotation = "argocd.argoproj.io/tracking-id"

type result struct {
	Group     string `json:"group"`
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Status    string `json:"status"`
	Message   string `json:"message"`
	SyncPhase string `json:"syncPhase"`
}

// readManifests returns every object of the folder's .yaml/.yml/.json files, in file-name order,
// each in the namespace and stamped with the app's tracking id.
func readManifests(dir, app, namespace string) ([]*unstructured.Unstructured, error) {
	var files []string
	for _, pattern := range []string{"*.yaml", "*.yml", "*.json"} {
		found, err := filepath.Glob(filepath.Join(dir, pattern))
		if err != nil {
			return nil, err
		}
		files = append(files, found...)
	}
	sort.Strings(files)
	var objs []*unstructured.Unstructured
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		items, err := kube.SplitYAML(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		objs = append(objs, items...)
	}
	for _, o := range objs {
		// Argo CD puts a namespaced object without one into the Application's destination
		// namespace; every object this test syncs is namespaced.
		if o.GetNamespace() == "" {
			o.SetNamespace(namespace)
		}
		ns := o.GetNamespace()
		gvk := o.GroupVersionKind()
		annotations := o.GetAnnotations()
		if annotations == nil {
			annotations = map[string]string{}
		}
		annotations[trackingAnnotation] = fmt.Sprintf("%s:%s/%s:%s/%s", app, gvk.Group, gvk.Kind, ns, o.GetName())
		o.SetAnnotations(annotations)
	}
	return objs, nil
}

func fail(code int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "gitops-sync: "+format+"\n", args...)
	os.Exit(code)
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster to sync to (required)")
	namespace := flag.String("namespace", "", "namespace of the application's objects (required)")
	app := flag.String("app", "", "application name the objects are tracked under (required)")
	prune := flag.Bool("prune", false, "delete tracked objects that are no longer in the folder")
	timeout := flag.Duration("timeout", 2*time.Minute, "give up on a sync that has not completed by then")
	flag.Parse()
	if *kubeconfig == "" || *namespace == "" || *app == "" || flag.NArg() != 1 {
		fail(2, "usage: gitops-sync --kubeconfig FILE --namespace NS --app NAME [--prune] DIR")
	}
	log := textlogger.NewLogger(textlogger.NewConfig())

	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fail(2, "reading %s: %v", *kubeconfig, err)
	}
	target, err := readManifests(flag.Arg(0), *app, *namespace)
	if err != nil {
		fail(2, "reading the manifests: %v", err)
	}

	prefix := *app + ":"
	clusterCache := cache.NewClusterCache(config,
		cache.SetNamespaces([]string{*namespace}),
		cache.SetLogr(log),
		cache.SetPopulateResourceInfoHandler(func(un *unstructured.Unstructured, _ bool) (any, bool) {
			managed := strings.HasPrefix(un.GetAnnotations()[trackingAnnotation], prefix)
			return managed, managed
		}),
	)
	gitops := engine.NewEngine(config, clusterCache, engine.WithLogr(log))
	cleanup, err := gitops.Run()
	if err != nil {
		fail(1, "starting the cluster cache: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	isManaged := func(r *cache.Resource) bool { managed, _ := r.Info.(bool); return managed }
	synced, err := gitops.Sync(ctx, target, isManaged, "git", *namespace, sync.WithPrune(*prune), sync.WithLogr(log))
	cancel()
	cleanup()

	out := struct {
		Resources []result `json:"resources"`
		Error     string   `json:"error,omitempty"`
	}{Resources: []result{}}
	code := 0
	if err != nil {
		out.Error = err.Error()
		code = 1
	}
	for _, r := range synced {
		out.Resources = append(out.Resources, result{
			Group: r.ResourceKey.Group, Kind: r.ResourceKey.Kind, Namespace: r.ResourceKey.Namespace,
			Name: r.ResourceKey.Name, Status: string(r.Status), Message: r.Message, SyncPhase: string(r.SyncPhase),
		})
		if r.Status == common.ResultCodeSyncFailed {
			code = 1
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(1, "writing the result: %v", err)
	}
	os.Exit(code)
}
